"""Bad input gets its own clear error, and loses nothing: the decoder works afterwards."""

import pytest
import torch

import goose
from goose.testing import ToyCausalLM, reference_greedy


def dec(model=None, **kw):
    return goose.compose(model or ToyCausalLM(16, max_positions=64), None, **kw)


def still_works(d):
    out = d.generate([1, 2, 3], max_new_tokens=5)
    assert out.token_ids == reference_greedy([1, 2, 3], 5, 16)


@pytest.mark.parametrize("prompt", [[], torch.zeros(0, dtype=torch.long)])
def test_empty_prompt(prompt):
    d = dec()
    with pytest.raises(goose.InvalidInputError, match="empty prompt"):
        d.generate(prompt)
    still_works(d)


def test_empty_string_prompt_with_tokenizer():
    class Tok:
        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[ord(c) % 16 for c in text]], dtype=torch.long)}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    d = goose.compose(ToyCausalLM(16), Tok(), sources=["pld"])
    with pytest.raises(goose.InvalidInputError, match="empty prompt"):
        d.generate("")
    assert len(d.generate("abc", max_new_tokens=3).text) == 3


def test_str_prompt_without_tokenizer():
    with pytest.raises(goose.InvalidInputError, match="no tokenizer"):
        dec().generate("hello")


def test_prompt_longer_than_context():
    d = dec()
    with pytest.raises(goose.InvalidInputError, match=r"prompt of 64 tokens does not fit the model's context of 64"):
        d.generate([1] * 64)
    with pytest.raises(goose.InvalidInputError, match=r"max_new_tokens \(20\) exceeds .* max_new_tokens <= 14"):
        d.generate([1] * 50, max_new_tokens=20)
    still_works(d)


def test_generation_up_to_the_context_edge_is_exact():
    d = dec(sources=["pld"], budget=30)
    prompt = [1, 2, 3, 4] * 10
    out = d.generate(prompt, max_new_tokens=24)  # exactly fills 64 positions
    assert out.token_ids == reference_greedy(prompt, 24, 16)


@pytest.mark.parametrize("bad", [16, 99, -1])
def test_prompt_token_outside_vocabulary(bad):
    d = dec()
    with pytest.raises(goose.InvalidInputError, match=rf"prompt token id {bad} is outside the vocabulary \[0, 16\)"):
        d.generate([1, bad, 2])
    still_works(d)


def test_batch_size_above_one_is_refused():
    d = dec()
    with pytest.raises(goose.InvalidInputError, match="batch size 2 is not supported"):
        d.generate(torch.tensor([[1, 2], [3, 4]]))
    out = d.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)  # batch of one is fine
    assert out.token_ids == reference_greedy([1, 2, 3], 5, 16)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_bad_max_new_tokens(bad):
    with pytest.raises(goose.InvalidInputError, match="max_new_tokens must be an int >= 0"):
        dec().generate([1, 2], max_new_tokens=bad)


def test_source_proposing_token_outside_vocabulary_is_named():
    class Wild(goose.DraftSource):
        name = "wild"

        def propose(self, state):
            return goose.Proposal.chain(self.name, [3, 4000])

    d = dec(sources=[Wild()], policy="chain")
    with pytest.raises(goose.DraftSourceError) as ei:
        d.generate([1, 2, 3], max_new_tokens=5)
    msg = str(ei.value)
    assert "'wild'" in msg and "token id 4000" in msg and "[0, 16)" in msg
    still_works(dec(sources=["pld"]))


def test_source_returning_garbage_is_named():
    class Garbage(goose.DraftSource):
        name = "garbage"

        def propose(self, state):
            return [1, 2, 3]

    with pytest.raises(goose.DraftSourceError, match="'garbage'.*must return a goose.Proposal"):
        dec(sources=[Garbage()]).generate([1, 2, 3], max_new_tokens=5)


def test_policy_with_wrong_root_is_refused():
    class WrongRoot(goose.TreePolicy):
        name = "wrong-root"

        def shape(self, ctx):
            return goose.DraftTree.from_chain(ctx.state.anchor + 1, [1, 2], "x")

    with pytest.raises(goose.PluginError, match="rooted at token"):
        dec(policy=WrongRoot()).generate([1, 2, 3], max_new_tokens=5)


def test_policy_over_its_limit_is_refused():
    class TooBig(goose.TreePolicy):
        name = "too-big"

        def shape(self, ctx):
            return goose.DraftTree.from_chain(ctx.state.anchor, [1] * 10, "x")

    with pytest.raises(goose.PluginError, match="over its limit of 4"):
        dec(policy=TooBig(), budget=4).generate([1, 2, 3], max_new_tokens=20)


def test_attention_implementation_that_ignores_masks_is_refused():
    m = ToyCausalLM(16)
    m.config._attn_implementation = "flash_attention_2"
    with pytest.raises(goose.UnsupportedModelError, match="'flash_attention_2' ignores custom 4-D masks.*sdpa"):
        goose.compose(m, None)


def test_sliding_window_model_is_refused_beyond_the_window():
    m = ToyCausalLM(16)
    m.config.sliding_window = 32
    m.config.layer_types = ["sliding_attention"]
    d = goose.compose(m, None, sources=["pld"], budget=8)
    with pytest.raises(goose.UnsupportedModelError, match="sliding-window attention \\(window 32\\)"):
        d.generate([1, 2, 3] * 5, max_new_tokens=20)
    # inside the window the tree mask is exact
    out = d.generate([1, 2, 3], max_new_tokens=10)
    assert out.token_ids == reference_greedy([1, 2, 3], 10, 16)


def test_model_without_config_is_refused():
    class Bare(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    with pytest.raises(goose.UnsupportedModelError, match="no `.config`"):
        goose.compose(Bare(), None)


def test_invalid_tree_messages_name_node_and_value():
    with pytest.raises(goose.InvalidTreeError, match="node 2: parent must satisfy 0 <= parent < 2.*got 5"):
        goose.DraftTree.build([1, 2, 3], [-1, 0, 5], "x")
    with pytest.raises(goose.InvalidTreeError, match="parents\\[0\\] must be -1, got 0"):
        goose.DraftTree.build([1, 2], [0, 0], "x")
    with pytest.raises(goose.InvalidTreeError, match="node 2: token 7 repeats its sibling node 1"):
        goose.DraftTree.build([1, 7, 7], [-1, 0, 0], "x")
    with pytest.raises(goose.InvalidTreeError, match="node 1: token must be a non-negative int, got -3"):
        goose.DraftTree.build([1, -3], [-1, 0], "x")
    with pytest.raises(goose.InvalidTreeError, match="at least the root"):
        goose.DraftTree.build([], [], "x")
    with pytest.raises(goose.InvalidTreeError, match="parents has 1 entries but tokens has 2"):
        goose.DraftTree.build([1, 2], [-1], "x")
