"""A source that works on text gets the decoder's tokenizer through its interface (``DraftSource.attach``)."""

import goose
from goose.testing import ToyCausalLM
from goose.testing.toy import reference_greedy

VOCAB = 16


class WordTokenizer:
    """Each word is its token id written out: "3 4 5" -> [3, 4, 5] (a stand-in for a Hugging Face tokenizer)."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [int(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class PhraseOptions(goose.Options):
    phrases: tuple[str, ...] = ()


class PhraseSource(goose.DraftSource):
    """Drafts the rest of a phrase (text, encoded with the decoder's tokenizer) whose first token is the anchor."""

    name = "phrases"
    Options = PhraseOptions

    def attach(self, model, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded = [] if tokenizer is None else [tokenizer.encode(p) for p in self.options.phrases]

    def propose(self, state):
        for ids in self.encoded:
            if len(ids) > 1 and ids[0] == state.anchor:
                return goose.Proposal.chain(self.name, ids[1:])
        return None


def test_a_text_source_gets_the_decoders_tokenizer_and_stays_lossless():
    prompt = [3, 5, 7, 2, 9]
    want = reference_greedy(prompt, 24, VOCAB, [])
    tok = WordTokenizer()
    # phrases along greedy's own continuation (so some are accepted) and one that is wrong
    text = [" ".join(str(t) for t in want[i:i + 5]) for i in (0, 6, 12)] + ["1 2 3 4"]
    src = PhraseSource(PhraseOptions(phrases=tuple(text)))
    dec = goose.compose(ToyCausalLM(VOCAB), tok, sources=[src], policy="chain", budget=8)
    assert src.tokenizer is tok
    out = dec.generate(prompt, max_new_tokens=24)
    assert out.token_ids == want
    assert out.stats.per_source["phrases"]["accepted"] > 0  # the encoded phrases were drafted and taken


def test_without_a_tokenizer_the_source_is_told_so():
    src = PhraseSource(PhraseOptions(phrases=("1 2",)))
    dec = goose.compose(ToyCausalLM(VOCAB), None, sources=[src], policy="chain", budget=8)
    assert src.tokenizer is None and src.encoded == []
    assert dec.generate([1, 2, 3], max_new_tokens=6).token_ids == reference_greedy([1, 2, 3], 6, VOCAB, [])
