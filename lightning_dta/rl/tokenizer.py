"""A character-level Hugging Face tokenizer built locally, for the toy tasks and tests.

Nothing can be downloaded at run time on the machines this project is tested on, and a real hub tokenizer
would bring a vocabulary of 32K-150K entries to a model whose whole point is to learn in a minute on a CPU.
So the toy tasks use one token per character of a small alphabet. It is a real
``PreTrainedTokenizerFast`` (``tokenizers`` WordLevel model), so everything downstream - ``model.generate``,
``decode``, padding, the OpenAI-server client - is exercised exactly as with a hub tokenizer.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lightning_dta.core.errors import ConfigError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: the alphabet starts at id 4


def make_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``alphabet`` plus ``<pad> <bos> <eos> <unk>`` (ids 0-3).

    ``len(tokenizer) == len(alphabet) + 4``: give the model at least that ``vocab_size``. Characters outside
    the alphabet encode to ``<unk>`` (visible, not dropped); ``decode`` joins characters without spaces.
    """
    if not alphabet:
        raise ConfigError("the alphabet is empty; give the characters the task uses, e.g. '0123456789>'")
    duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if duplicates:
        raise ConfigError(f"the alphabet repeats {duplicates!r}; each character must appear once")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character a token
    backend.decoder = decoders.Fuse()  # "1" "2" -> "12", not "1 2"
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False)
