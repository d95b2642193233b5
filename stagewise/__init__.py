"""stagewise: LLM inference, stage by stage.

from stagewise import LLM, SamplingParams
llm = LLM()                                   # SmolLM2-135M-Instruct, the torch tier (fast PyTorch)
print(llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].text)

The names below load on first use, so `import stagewise` (and the command
line's start, before it can catch Ctrl-C) does not import torch.
"""

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "stagewise.engine.llm",
    "RequestOutput": "stagewise.engine.outputs",
    "TokenEvent": "stagewise.engine.outputs",
    "SamplingParams": "stagewise.sampling_params",
    "StagewiseError": "stagewise.errors",
}
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StagewiseError", "TokenEvent", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")
