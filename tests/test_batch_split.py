"""A global batch the mesh axes that split it do not divide: refused when the axes were sized
by hand, a warning (the batch is replicated along them) when one was sized ``-1``
(:func:`maxnnx.train.checks.check_batch_and_length`)."""

import logging

import pytest

import maxnnx
from maxnnx.config import MeshConfig
from maxnnx.sharding import logical_rules, make_mesh
from maxnnx.train import TrainConfig
from maxnnx.train.checks import check_batch_and_length

MODEL = maxnnx.get_preset('tiny')


def _check(batch, mesh_config):
  config = TrainConfig(global_batch_size=batch, seq_len=32, mesh=mesh_config)
  check_batch_and_length(config, MODEL, make_mesh(mesh_config), logical_rules(mesh_config))


def test_a_batch_the_named_axes_divide_passes(caplog):
  with caplog.at_level(logging.WARNING):
    _check(12, MeshConfig(data=2, fsdp=2, tensor=2))
  assert not caplog.records


def test_a_batch_the_named_axes_do_not_divide_is_refused():
  with pytest.raises(ValueError, match=r'global_batch_size=6 is not divisible by mesh.data=2 '
                                       r'\* mesh.fsdp=4 \(= 8\).*change one of them'):
    _check(6, MeshConfig(data=2, fsdp=4))


def test_an_axis_sized_minus_one_warns_that_the_batch_is_replicated(caplog):
  with caplog.at_level(logging.WARNING):
    _check(6, MeshConfig(data=1, fsdp=-1))
  assert any('global_batch_size=6 is not divisible by mesh.fsdp=8' in r.getMessage()
             and 'replicated' in r.getMessage() for r in caplog.records)


def test_a_sequence_past_the_models_positions_is_refused():
  config = TrainConfig(global_batch_size=8, seq_len=MODEL.max_position_embeddings + 1)
  with pytest.raises(ValueError, match='longer than the model'):
    check_batch_and_length(config, MODEL, make_mesh(MeshConfig()), logical_rules(MeshConfig()))
