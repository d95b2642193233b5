"""stagewise: LLM inference, stage by stage.

from stagewise import LLM, SamplingParams
llm = LLM()                                   # SmolLM2-135M-Instruct, naive PyTorch stages
print(llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].text)
"""

from stagewise.engine.llm import LLM
from stagewise.engine.outputs import RequestOutput, TokenEvent
from stagewise.engine.sampling_params import SamplingParams
from stagewise.errors import StagewiseError

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StagewiseError", "TokenEvent", "__version__"]
