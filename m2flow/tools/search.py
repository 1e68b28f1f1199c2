"""The ``search`` tool: BM25 (the ``bm25s`` library) over a local corpus, offline. The corpus
is a list of documents (strings, or mappings with ``text`` and an optional ``title``), a JSONL
file of them (gzipped when its name ends in ``.gz``), or the name of one that ships with the package (``CORPORA``: ``invented``, the
facts of invented entities that the built-in ``invented`` questions ask about), indexed once when the tool is made; a
query returns the ``k`` best passages that share a word with it, numbered, each cut to
``max_chars``."""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Document = str | Mapping[str, Any]
CORPORA = Path(__file__).with_name("corpora")  # the built-in corpora: <name>.jsonl.gz


def read_corpus(corpus: str | Path | Sequence[Document], text_key: str = "text",
                title_key: str = "title") -> list[tuple[str, str]]:
    """``(title, text)`` of every document: from a list, or from a JSONL file (one document
    a line: an object, or a JSON string; gzipped if its name ends in ``.gz``)."""
    if isinstance(corpus, (str, Path)):
        builtin = CORPORA / f"{corpus}.jsonl.gz"
        path = builtin if isinstance(corpus, str) and "/" not in corpus and builtin.is_file() else Path(corpus)
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")) as f:
            docs = [json.loads(line) for line in f if line.strip()]
    else:
        docs = list(corpus)
    found = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            found.append(("", doc))
        elif isinstance(doc, Mapping) and isinstance(doc.get(text_key), str):
            found.append((str(doc.get(title_key) or ""), doc[text_key]))
        else:
            raise ValueError(f"search corpus: document {i} has no {text_key!r} string")
    if not found:
        raise ValueError("search corpus: no documents")
    return found


class Search:
    """BM25 search over a local corpus (module docstring)."""

    name = "search"

    def __init__(self, corpus: str | Path | Sequence[Document], k: int = 3, max_chars: int = 1000,
                 text_key: str = "text", title_key: str = "title", stopwords: str = "en"):
        import bm25s  # a second to import: only when a search tool is made

        self.docs = read_corpus(corpus, text_key, title_key)
        self.k, self.max_chars, self.stopwords = k, max_chars, stopwords
        self.index = bm25s.BM25()
        texts = [f"{title}\n{text}" if title else text for title, text in self.docs]
        self.index.index(bm25s.tokenize(texts, stopwords=stopwords, show_progress=False), show_progress=False)

    def top(self, query: str) -> list[tuple[int, float]]:
        """``(document index, score)`` of the best matches, best first, scores above zero."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords=self.stopwords, show_progress=False)
        if not tokens.vocab:  # nothing but stopwords
            return []
        found, scores = self.index.retrieve(tokens, k=min(self.k, len(self.docs)), show_progress=False)
        return [(int(d), float(s)) for d, s in zip(found[0], scores[0]) if s > 0]

    def call(self, query: str) -> str:
        """Search the knowledge base and return the passages that best match the query.

        Args:
            query: What to look for, in a few words, e.g. "capital of France".
        """
        hits = self.top(query)
        if not hits:
            return "No passage matches the query."
        passages = []
        for n, (i, _) in enumerate(hits, 1):
            title, text = self.docs[i]
            text = text if len(text) <= self.max_chars else text[:self.max_chars] + " ..."
            passages.append(f"[{n}] {title}\n{text}" if title else f"[{n}] {text}")
        return "\n\n".join(passages)
