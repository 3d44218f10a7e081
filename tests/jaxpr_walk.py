"""Walk a jaxpr and every jaxpr nested in it (custom_vjp, pjit, cond, scan...), for tests."""

import jax


def equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs its equations carry, depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, tuple | list) else (param,):
        inner = getattr(sub, 'jaxpr', sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from equations(inner)
