"""Scale-out on Ray Serve: engine replicas as a Serve deployment, reached through a handle behind EngineClient.

- replica.py: `EngineReplica`, the deployment: one engine per replica (its CPUs or GPU from Serve's actor options).
- client.py: `RayEngineClient`, the gateway's EngineClient over the deployment's handle (streaming, affinity,
  retries before the first token, replica status polled by broadcast).
- deploy.py: starts or joins a Ray cluster and runs the deployment (`loraplex serve --ray`).
"""
