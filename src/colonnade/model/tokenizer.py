"""Byte-level BPE tokenizers trained locally, saved like a downloaded one.

The `tiny` preset cannot download a tokenizer, so it trains one on the text
it will see (the environment's corpus and prompts). The result is a normal
`PreTrainedTokenizerFast` with a ChatML template, so the code that formats
prompts for SmolLM2 or Qwen formats them for `tiny` too.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# ChatML, the template SmolLM2 and Qwen use; `add_generation_prompt` opens
# the assistant turn the model is asked to write.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 0
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any UTF-8 text round-trips) trained on `texts`.

    `min_frequency`: a pair is merged into a token only if it occurs that
    often in `texts`. A model trained from scratch learns a token's embedding
    only from the examples that hold it; a name seen a dozen times would
    otherwise become a token of its own, which a held-out name never shares,
    so the model cannot copy it. With the floor, rare names are spelled in
    pieces that many names share (syllables, letter pairs, digits).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte symbols + specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=min_frequency,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
