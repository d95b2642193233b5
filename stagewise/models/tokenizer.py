"""Old home of the `Tokenizer` (one release): it lives in `stagewise.tokenizer` now.

The file readers are functions of `stagewise.models.tokenizer_files`
(`tokenizer_from_gguf`, `tokenizer_from_hf_dir`, `tokenizer_to_hf_dir`) and the
chat templates of `stagewise.models.chat_template` (`apply_chat_template`,
`chat_segments`).
"""

from stagewise.tokenizer.vocabulary import Tokenizer

__all__ = ["Tokenizer"]
