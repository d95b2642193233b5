"""Each LLM's tokenizer is its own: a chat template set on one LLM changes no other one's prompts."""

from stagewise import LLM
from stagewise.tokenizer.vocabulary import Tokenizer

PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_tiny_tokenizers_are_not_one_shared_object():
    a, b = Tokenizer.tiny(), Tokenizer.tiny()
    a.chat_template = PLAIN
    assert b.chat_template != PLAIN and Tokenizer.tiny().chat_template == b.chat_template
    assert a.tokens == b.tokens and a.tokens is not b.tokens


def test_a_chat_template_set_on_one_llm_leaves_the_others_alone(tiny):
    pairs = [(LLM("tiny"), LLM("tiny")), (LLM(tiny), LLM(tiny))]  # two loads; one LoadedModel shared
    for llm, other in pairs:
        before = other.encode("hi", chat=True)
        llm.tokenizer.chat_template = PLAIN
        assert llm.encode("hi", chat=True) == llm.encode("hi")  # the new template: the bare message
        assert other.encode("hi", chat=True) == before != llm.encode("hi", chat=True)
    assert tiny.tokenizer.chat_template != PLAIN  # nor the LoadedModel's
