"""Parallelism schedules that wrap layers (pipeline parallelism over the ``stage`` mesh axis).

This package sits between :mod:`maxnnx.layers` / :mod:`maxnnx.sharding` and the
models: models call into it, it never imports models or training code.
"""

from maxnnx.parallel.pipeline import pipeline_stack

__all__ = ['pipeline_stack']
