"""Example components for tests and docs: small, complete, and written as a plugin author would write them."""

from __future__ import annotations

from pydantic import Field

from goose.interfaces import DraftSource, DraftState, Options, Proposal


class RecallOptions(Options):
    context: int = Field(3, ge=1, description="how many of the last tokens must match an earlier generation's text")
    max_len: int = Field(12, ge=1, description="longest chain drafted (the tokens that followed the match)")
    confidence: float = Field(0.9, ge=0.0, le=1.0, description="the confidence every proposal reports")


class RecallSource(DraftSource):
    """A source that learns across requests through ``end`` (docs/plugins.md walks through it): it drafts what
    followed the last ``context`` tokens in the committed text (prompt + answer) of this component set's earlier
    generations, latest first. ``history`` holds those texts; ``ends`` every output ``end`` received."""

    name = "recall"
    Options = RecallOptions

    def __init__(self, options: RecallOptions | None = None):
        super().__init__(options)
        self.history: list[list[int]] = []
        self.ends: list = []

    def propose(self, state: DraftState) -> Proposal | None:
        o = self.options
        tail = list(state.tokens[-o.context:])
        for seq in reversed(self.history):
            for i in range(len(seq) - o.context):
                if seq[i:i + o.context] == tail:
                    more = seq[i + o.context:i + o.context + o.max_len]
                    if more:
                        return Proposal.chain(self.name, more, confidence=o.confidence)
        return None

    def end(self, output) -> None:
        self.ends.append(output)
        self.history.append([*output.prompt_ids, *output.token_ids])
