"""The lab: simulator, workloads, replay and mock engines. It imports the router; the router never imports it."""
