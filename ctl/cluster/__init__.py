"""ntx replicas under Ray Serve (docs/CLUSTER.md): an OpenAI ingress that routes each request to
the replica holding its prefix while the load allows, else the less loaded (``router``); replicas
that each run one ntx instance (``replica``); the Serve application (``app``, needs the ray
extra); ``ntxctl cluster up|status|down`` (``control``)."""
