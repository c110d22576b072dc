"""The executor link: the ZeroMQ socket to the executor, the registered executor and its supervisor."""
