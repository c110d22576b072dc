"""The scheduler-executor link's endpoints (where it listens, and whether that is safe) and its CURVE keys."""
