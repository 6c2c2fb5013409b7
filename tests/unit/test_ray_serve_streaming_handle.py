"""The gateway streams by value through Serve's private `_by_reference` option, and still streams (by reference)
on a Ray whose handles lack it. The installed Ray has the option, so the second case needs a handle without it:
a stand-in whose options() refuses unknown keywords, as DeploymentHandle.options' signature does."""

from __future__ import annotations

import inspect
import logging

from ray.serve.handle import DeploymentHandle

from loraplex.ray_serve.client import _streaming


class HandleWithout:
    """options() accepting only the keywords named (a TypeError for any other, as a Python signature gives)."""

    def __init__(self, keywords: set[str]):
        self.keywords, self.chosen = keywords, None

    def options(self, **kw):
        unknown = set(kw) - self.keywords
        if unknown:
            raise TypeError(f"options() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        self.chosen = kw
        return self


def test_the_installed_rays_handles_take_the_option_the_gateway_uses():
    assert "_by_reference" in inspect.signature(DeploymentHandle.options).parameters
    handle = HandleWithout({"stream", "_by_reference"})
    assert _streaming(handle).chosen == {"stream": True, "_by_reference": False}


def test_a_ray_without_the_option_streams_by_reference_and_says_so(caplog):
    handle = HandleWithout({"stream"})
    with caplog.at_level(logging.WARNING, logger="loraplex.ray_serve"):
        assert _streaming(handle).chosen == {"stream": True}
    assert "no _by_reference option" in caplog.text
