"""The workflow router, without Ray: templates and their versions, live clients' step graphs,
where each prefix is held, the hints each replica is owed, and the routing policy
(`core.routing`). The simulator drives it in process; serving wraps it in the router actor
(`serve/router_actor.py`). Nothing here imports Ray, an engine's runtime or serving."""
