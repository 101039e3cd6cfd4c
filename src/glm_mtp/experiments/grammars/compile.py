"""Grammars compiled by xgrammar against a model's vocabulary, and their matchers.

xgrammar's ``TokenizerInfo`` is built from the vocabulary the run tokenizes with:

- the package's byte-level BPE (``experiments.training.bpe.BpeTokenizer``): each id's bytes as they are
  (xgrammar's RAW vocabulary), no stop token (the toy has none);
- transformers' tokenizers (``experiments.targets.hf_target.HfTokenizer``): ``TokenizerInfo.from_huggingface``,
  which reads the vocabulary and its byte encoding; the tokenizer's EOS is the stop token (without
  one, xgrammar detects the stop tokens itself); the tokenizer's special tokens are never text.

The bitmask width is the model's ``vocab_size`` (the drafter's; DESIGN.md §10), which may exceed
the tokenizer's: ids past the tokenizer are never allowed. Matchers never terminate without a
stop token (xgrammar's ``terminate_without_stop_token=False``), so with a vocabulary that has none
a complete grammar ends the output by allowing nothing (an empty mask), not by terminating.

JSON schemas compile to compact JSON (``any_whitespace=False``: no whitespace between tokens but
what the separators ``", "`` and ``": "`` hold), the canonical form a server emits.
"""

from __future__ import annotations

from typing import Any

from .spec import GrammarSpec, require_xgrammar, xgrammar_message


def tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    """xgrammar's ``TokenizerInfo`` for ``tokenizer`` padded to ``vocab_size`` ids.

    Args:
        tokenizer: a ``BpeTokenizer`` (``vocab``: one bytes object per id) or an ``HfTokenizer``
            (``tokenizer``: transformers' tokenizer).
        vocab_size: the model's vocabulary (the bitmask's width); at least the tokenizer's.
    """
    xgr = require_xgrammar()
    if hasattr(tokenizer, "tokenizer"):  # transformers' tokenizer, wrapped by HfTokenizer
        hf = tokenizer.tokenizer
        if len(hf) > vocab_size:
            raise ValueError(f"the tokenizer holds {len(hf)} tokens, more than the model's vocab_size={vocab_size}")
        eos = getattr(hf, "eos_token_id", None)
        stops = None if eos is None else [eos]  # None: xgrammar looks for stop tokens itself (it refuses [])
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
        return without_special_tokens(info, list(getattr(hf, "all_special_ids", [])))
    vocab = getattr(tokenizer, "vocab", None)
    if not isinstance(vocab, list) or not all(isinstance(v, bytes) for v in vocab):
        raise ValueError(f"a grammar needs the model's vocabulary: {type(tokenizer).__name__} gives neither a "
                         "byte vocabulary (vocab) nor transformers' tokenizer")
    if len(vocab) > vocab_size:
        raise ValueError(f"the tokenizer holds {len(vocab)} tokens, more than the model's vocab_size={vocab_size}")
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[])


def without_special_tokens(info: Any, special_ids: list[int]) -> Any:
    """``info`` with the tokenizer's special tokens (pad, bos, ...) made special for xgrammar too
    (an empty decoded string: never text a grammar matches), so no grammar allows them inside its
    output; the stop tokens stay stop tokens. xgrammar reads a special token whose text it can
    decode (a WordLevel ``<pad>``, say) as that text otherwise."""
    vocab = list(info.decoded_vocab)
    if all(not (0 <= i < len(vocab)) or vocab[i] == b"" for i in special_ids):
        return info
    for i in special_ids:
        if 0 <= i < len(vocab):
            vocab[i] = b""
    xgr = require_xgrammar()
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size, stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space)


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one vocabulary (each distinct text once) and makes matchers.

    Args:
        tokenizer / vocab_size: as ``tokenizer_info``'s.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.xgr = require_xgrammar()
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = self.xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compile(self, spec: GrammarSpec) -> Any:
        """xgrammar's ``CompiledGrammar`` of ``spec``; ``ValueError`` naming its origin when it
        does not compile against this vocabulary."""
        key = (spec.kind, spec.sha256)
        if key not in self._compiled:
            c = self._compiler
            try:
                if spec.kind == "regex":
                    compiled = c.compile_regex(spec.text)
                elif spec.kind == "ebnf":
                    compiled = c.compile_grammar(spec.text)
                elif spec.kind == "json_schema":
                    compiled = c.compile_json_schema(spec.text, any_whitespace=False)
                else:
                    raise ValueError(f"grammar kind must be regex, ebnf or json_schema, got {spec.kind!r}")
            except RuntimeError as e:
                raise ValueError(f"{spec.origin}: the {spec.kind} grammar does not compile: {xgrammar_message(e)}") \
                    from None
            self._compiled[key] = compiled
        return self._compiled[key]

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh ``GrammarMatcher`` of ``spec``, at the start of the output."""
        return self.xgr.GrammarMatcher(self.compile(spec), terminate_without_stop_token=False)
