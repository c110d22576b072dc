"""Configuration shared by every kvserve process: the defaults and limits, and the flags generated
from config dataclasses."""
