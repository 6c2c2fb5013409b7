"""`loraplex serve --ray`: the engine runs as Ray Serve replicas (loraplex/ray_serve), this process is the gateway.

The replicas take the same engine options as `serve`; each builds its engine from them in its own process, on the
CPUs or GPU its actor options give it.
"""

from __future__ import annotations

import argparse
import functools
import sys

from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol

from loraplex.cli.engine_args import ENGINE_OPTIONS, build_engine


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (engine replicas instead of an engine in this process)")
    g.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="run the engine as Ray Serve replicas: auto (the default when given alone) starts a local "
                        "Ray cluster; the head's address (host:6379) joins one, from a machine that is a node of it "
                        "(`ray start --address=host:6379` first). Without a replica count the gateway joins the "
                        "replicas another gateway deployed, if they run")
    g.add_argument("--replicas", type=int, help="a fixed number of engine replicas (default 1)")
    g.add_argument("--min-replicas", type=int, help="autoscaling on ongoing requests: the fewest replicas")
    g.add_argument("--max-replicas", type=int, help="autoscaling on ongoing requests: the most replicas")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)")
    g.add_argument("--replica-gpus", type=float,
                   help="GPUs Ray reserves for each replica (default: 1 when the cluster has GPUs, else 0)")


def ray_options_given(args: argparse.Namespace) -> list[str]:
    """The Ray Serve options given without --ray (a mistake: they would be ignored)."""
    names = ("replicas", "min_replicas", "max_replicas", "replica_gpus")
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]


def replica_plan(args: argparse.Namespace, num_gpus: float = 0.0):
    """The ReplicaPlan the options give (ValueError, in one line, when the counts are wrong)."""
    from loraplex.ray_serve.deploy import ReplicaPlan

    return ReplicaPlan(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                       num_cpus=args.replica_cpus, num_gpus=num_gpus)


def check_ray_options(args: argparse.Namespace) -> None:
    """Fails in one line on wrong counts or a Ray Client address, before a port or a cluster is taken."""
    replica_plan(args)
    if args.ray.startswith("ray://"):
        raise ValueError("--ray takes the head's address (host:6379) from a node of the cluster: Ray Client "
                         "(ray://) cannot stream responses from Serve")


def ray_engine(args: argparse.Namespace):
    """The gateway's engine client over the replicas (deployed or joined), and the plugin tying its status
    polling to the app's life. Fails in one line when Ray is missing or the options are wrong."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'loraplex[ray]'") from None
    from loraplex.ray_serve.deploy import connect_cluster, deploy

    check_ray_options(args)  # (before a cluster starts)
    connect_cluster(args.ray)
    gpus = args.replica_gpus if args.replica_gpus is not None else (1.0 if ray.cluster_resources().get("GPU") else 0.0)
    engine_args = argparse.Namespace(**{name: getattr(args, name, None) for name in ENGINE_OPTIONS})
    client = deploy(args.ray, replica_plan(args, gpus), functools.partial(build_engine, engine_args))
    print(f"loraplex: {len(client.replicas())} engine replicas on the Ray cluster at "
          f"{ray.get_runtime_context().gcs_address}", file=sys.stderr, flush=True)
    return client, [ClientLifecycle(client)]


class ClientLifecycle(InitPluginProtocol):
    """Starts the client's status polling with the app, and stops it after the app has drained."""

    def __init__(self, client):
        self.client = client

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.on_startup.append(self.client.start)
        app_config.on_shutdown.append(self.client.close)
        return app_config
