"""The engine's LoRA adapters changed while it serves: :class:`AdapterLoading`, a part of
:class:`~maxnnx.serving.Engine` (:mod:`maxnnx.serving.lora` holds the stacks themselves)."""

from __future__ import annotations

import logging

from maxnnx.serving.lora import read_adapter

logger = logging.getLogger('maxnnx.serving.engine')  # the engine's own log


class AdapterLoading:
  """:meth:`load_lora` and :meth:`unload_lora` of an engine with adapter stacks.

  The engine provides ``adapters`` (a :class:`~maxnnx.serving.lora.ServedAdapters`),
  ``runner`` (its :class:`~maxnnx.serving.model_runner.ModelRunner`), ``scheduler``, ``config``,
  ``_model`` (what adapters are read against) and ``_requests``.
  """

  @property
  def lora_names(self) -> tuple[str, ...]:
    """The names of the LoRA adapters served (``lora_modules``, then those loaded later), in
    the order they were loaded."""
    return self.adapters.names

  def load_lora(self, name: str, path: str) -> int:
    """Serve the PEFT adapter in directory ``path`` as ``name`` from the next step on; returns
    its slot. It is written into a free slot of the adapter stacks (shapes unchanged: nothing
    is compiled), and its requests never reuse prefix pages cached for another adapter, even
    one served before under the same name or in the same slot.

    Raises:
      ValueError: one line naming the fix: ``name`` is loaded already, no slot is free
        (``max_loras``), the adapter's rank is above ``max_lora_rank``, it adapts a projection
        that has no slots (``lora_target_modules``), or its files do not load.
    """
    if not self.runner.lora_stacks:
      raise ValueError('This engine has no adapter slots; start it with lora_target_modules '
                       '(e.g. q_proj,v_proj) or lora_modules to load adapters later.')
    if not isinstance(name, str) or not name:
      raise ValueError(f'lora_name={name!r}: give the adapter a non-empty name.')
    slot = self.adapters.add(name, str(path))  # refuses a name in use or no free slot
    try:
      adapter = read_adapter(self._model, name, str(path), self.config.max_lora_rank,
                             'load_lora')
      self.runner.write_adapter(slot, adapter)
    except Exception:
      self.adapters.remove(name)
      raise
    logger.info('Loaded LoRA adapter %r from %s into slot %d.', name, path, slot)
    return slot

  def unload_lora(self, name: str) -> int:
    """Stop serving adapter ``name``; returns the slot freed (zeroed, ready for another load).

    The prefix pages cached for its requests are freed at once (no later request can hit
    them); the base model's and other adapters' stay cached. Requests of the adapter must have
    finished: an unload is refused while any is unfinished (cancel them, or unload once they
    end).

    Raises:
      ValueError: ``name`` is not served (an
        :class:`~maxnnx.serving.lora.UnknownAdapterError`), or has unfinished requests.
    """
    slot = self.adapters.slot(name)
    busy = sum(request.lora_slot == slot for request in self._requests.values())
    if busy:
      raise ValueError(f'lora_name {name!r} has {busy} unfinished request(s); unload it once '
                       'they finish, or cancel them first.')
    self.runner.write_adapter(slot, None)
    self.adapters.remove(name)
    freed = self.scheduler.kv_cache.forget_adapter(slot)
    logger.info('Unloaded LoRA adapter %r (slot %d; %d cached pages freed).', name, slot, freed)
    return slot


__all__ = ['AdapterLoading']
