"""Several engines behind one router: the router's command line and the replica set.

Not a service: nothing here schedules or runs a model. It starts processes (`kvserve serve`
per replica, `vllm-router` in front) and watches them.
"""
