"""The engine driven by 2 processes x 1 CPU device (`pkvattn.distributed`).

Two subprocesses join through `jax.distributed` (a free local port, gloo
CPU collectives), build one tp=2 mesh over both processes' devices and run
the same greedy requests; their tokens must equal a single-process run
with 2 forced host devices at tp=2 and without a mesh. The three processes
run concurrently, each under a timeout.
"""

import os
import socket
import subprocess
import sys

import jax
import pytest

from pkvattn import distributed
from cpu_devices import result_of, xla_flags

_SCRIPT = r'''
import json, os, sys
from pkvattn import distributed
if os.environ.get("PKVATTN_NUM_PROCESSES"):
  distributed.initialize()
import jax
import jax.numpy as jnp
from pkvattn import parallel
from pkvattn.engine import Engine, EngineConfig, SamplingParams
from pkvattn.models import Model, init_params, load_model
from pkvattn.models.tiny import replace

tok = load_model("tiny-llama").tokenizer
cfg = replace(load_model("tiny-llama").cfg, num_qo_heads=4, num_kv_heads=2)
model = Model("t", cfg, init_params(cfg, jax.random.key(1), scale=0.08), tok)
prompts = [tok.encode(p) for p in ("hello world", "two processes", "a")]
sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
ec = EngineConfig(page_size=8, num_slots=32, max_seqs=4, max_num_tokens=32,
                  max_model_len=64, token_buckets=(32,), decode_steps=4)
res = {"process": jax.process_index(), "devices": jax.device_count(),
       "local": jax.local_device_count()}
runs = sys.argv[1].split(",")
for run in runs:
  mesh = None if run == "none" else parallel.make_mesh(2)
  res[run] = Engine(model, ec, mesh=mesh).generate(prompts, sp)
print("RESULT" + json.dumps(res), flush=True)
'''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(runs, **env_extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **env_extra)
  return subprocess.Popen([sys.executable, "-c", _SCRIPT, runs], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _result(proc, timeout=240):
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"timed out: {err[-3000:]}")
  assert proc.returncode == 0, err[-4000:]
  return result_of(out)


def test_two_processes_match_one():
  port = _free_port()
  workers = [_start("tp2", XLA_FLAGS=xla_flags(1),
                    PKVATTN_COORDINATOR=f"127.0.0.1:{port}",
                    PKVATTN_NUM_PROCESSES="2", PKVATTN_PROCESS_ID=str(i))
             for i in range(2)]
  single = _start("none,tp2", XLA_FLAGS=xla_flags(2))
  expected = _result(single)
  got = [_result(w) for w in workers]
  assert expected["devices"] == 2 and expected["local"] == 2
  assert all(len(o) == 8 for o in expected["none"])
  assert expected["tp2"] == expected["none"]
  for i, r in enumerate(got):
    assert (r["process"], r["devices"], r["local"]) == (i, 2, 1)
    assert r["tp2"] == expected["none"], i


def test_initialize_launch_errors(monkeypatch):
  for name in (distributed.COORDINATOR_ENV, distributed.NUM_PROCESSES_ENV,
               distributed.PROCESS_ID_ENV):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(ValueError, match="together"):
    distributed.initialize("127.0.0.1:1", num_processes=2)
  with pytest.raises(ValueError, match="Invalid process_id"):
    distributed.initialize("127.0.0.1:1", num_processes=2, process_id=2)
  assert distributed.initialize() is False  # nothing set: one process
  monkeypatch.setenv(distributed.NUM_PROCESSES_ENV, "two")
  with pytest.raises(ValueError, match="PKVATTN_NUM_PROCESSES"):
    distributed.initialize()


def _fake_jax_launch(monkeypatch):
  """Records what `initialize` asks of jax instead of joining a cluster."""
  calls = []
  monkeypatch.setattr(jax.config, "update",
                      lambda *a: calls.append(("update",) + a))
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda *a, **k: calls.append(("initialize", a, k)))
  return calls


def _set_launch_env(monkeypatch, coordinator, num_processes, process_id):
  for name, value in ((distributed.COORDINATOR_ENV, coordinator),
                      (distributed.NUM_PROCESSES_ENV, num_processes),
                      (distributed.PROCESS_ID_ENV, process_id)):
    monkeypatch.setenv(name, value)


def test_initialize_joins_from_the_environment(monkeypatch):
  calls = _fake_jax_launch(monkeypatch)
  _set_launch_env(monkeypatch, "10.0.0.1:777", " 3 ", "2")  # last process
  assert distributed.initialize() is True
  assert calls == [
      ("update", "jax_cpu_collectives_implementation", "gloo"),
      ("initialize", ("10.0.0.1:777",), dict(num_processes=3, process_id=2))]


def test_initialize_arguments_win_over_the_environment(monkeypatch):
  calls = _fake_jax_launch(monkeypatch)
  _set_launch_env(monkeypatch, "10.0.0.1:777", "3", "2")
  assert distributed.initialize("127.0.0.1:5", num_processes=1, process_id=0,
                                local_device_ids=(1, 0)) is True
  assert calls[-1] == ("initialize", ("127.0.0.1:5",),
                       dict(num_processes=1, process_id=0,
                            local_device_ids=[1, 0]))
  # Each value falls back to its own variable only.
  calls.clear()
  assert distributed.initialize(process_id=0)
  assert calls[-1] == ("initialize", ("10.0.0.1:777",),
                       dict(num_processes=3, process_id=0))


def test_initialize_rejects_out_of_range_launches(monkeypatch):
  calls = _fake_jax_launch(monkeypatch)
  for n, pid in ((0, 0), (2, -1), (2, 2), (1, 1), (-1, -1)):
    with pytest.raises(ValueError, match="Invalid process_id"):
      distributed.initialize("127.0.0.1:1", num_processes=n, process_id=pid)
  assert calls == []
  # Blank variables count as unset: one process.
  _set_launch_env(monkeypatch, "", "  ", "")
  assert distributed.initialize() is False and calls == []
