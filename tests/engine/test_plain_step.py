"""The paged runner's plain step runs without the CUDA-graph code (engine/paged_runner.py).

`GraphRunner` (engine/graph_runner.py) and `DecodeGraphs` (engine/cuda_graphs.py) wrap the plain
step from outside: a paged run without `cuda_graphs` never imports them. A fresh interpreter, in
which the two modules cannot be imported at all, runs greedy and seeded requests, speculation
included, and ends with neither module loaded; asking for `cuda_graphs` there fails at the import
(the blocker works), and the tokens equal this process's, where the modules can be imported.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from stagewise import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
GRAPH_MODULES = ("stagewise.engine.cuda_graphs", "stagewise.engine.graph_runner")
PROMPTS = ["Hello there, how are you?", "A", "The quick brown fox"]

SCRIPT = """
import importlib.abc, json, sys
import torch

BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED:
            raise ModuleNotFoundError(f"blocked: {{name}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.models.registry import load_model

tiny = load_model("tiny", dtype=torch.float32)
params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
out = {{"plain": [o.token_ids for o in LLM(tiny).generate({prompts!r}, params)]}}
spec = LLM(tiny, speculative_config="ngram:2")
out["spec"] = [o.token_ids for o in spec.generate({prompts!r}, params)]
out["loaded"] = sorted(name for name in BLOCKED if name in sys.modules)
try:
    LLM(tiny, engine_config=EngineConfig(cuda_graphs=True), stage_backends={{"paged_attention": "triton"}})
    out["graphs"] = "built"
except ModuleNotFoundError as exc:
    out["graphs"] = str(exc)
print(json.dumps(out))
"""


def test_the_plain_step_runs_without_the_cuda_graph_modules(tiny):
    script = SCRIPT.format(blocked=GRAPH_MODULES, prompts=PROMPTS)
    env = {**os.environ, "STAGEWISE_QUIET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []  # neither module was imported by the plain runs
    assert out["graphs"].startswith("blocked: stagewise.engine.")  # cuda_graphs=True needs them
    params = [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    ]
    here = [o.token_ids for o in LLM(tiny).generate(PROMPTS, params)]
    here_spec = [o.token_ids for o in LLM(tiny, speculative_config="ngram:2").generate(PROMPTS, params)]
    assert out["plain"] == here and out["spec"] == here_spec, (out, here, here_spec)
    assert [len(t) for t in here] == [5, 4, 6]
