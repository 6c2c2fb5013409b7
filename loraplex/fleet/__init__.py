"""Engine workers and the fleet over them: several engine processes (or machines) behind one
serving instance, each adapter's requests kept on few workers.

`worker_app` serves one engine over HTTP (`loraplex worker`); `remote` calls a worker; `fleet` is
the EngineClient over many, placing requests with `placement`; `wire` is what travels between them.
Like the platform, this package imports nothing from the engine but its api module.
"""
