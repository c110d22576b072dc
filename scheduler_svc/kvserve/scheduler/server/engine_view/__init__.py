"""The engine view: one bounded JSON snapshot of the engine, and the streams that hand it to the web page."""
