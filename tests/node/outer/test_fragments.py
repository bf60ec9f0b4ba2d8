"""Streamed fragments (node/outer/fragments.py): the plan, the schedule, and the outer step per fragment
against plain DiLoCo and a hand-computed step."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from node.model.gpt import GPT, model_config
from node.outer.diloco import DiLoCo, flatten_params
from node.outer.fragments import (
    FragmentedDiLoCo,
    due_fragments,
    fragment_offset,
    fragment_plan,
    model_fragment_plan,
)
from node.outer.host_copy import HostCopies
from node.outer.state import tensor_hash


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(model_config("nano", vocab_size=64, seq_len=16))


def _names_and_sizes(model: nn.Module) -> tuple[list[str], list[int]]:
    return [name for name, _ in model.named_parameters()], [p.numel() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_the_plan_strides_blocks_that_fill_the_fragments_and_places_the_rest_largest_first() -> None:
    names, sizes = _names_and_sizes(_gpt())
    plan = fragment_plan(names, sizes, 2)
    by_fragment = [[names[i] for i in members] for members in plan.fragments]
    # nano's 4 layers (213,248 numbers each) fill 2 fragments: 0 and 2 in fragment 0, 1 and 3 in 1.
    # The rest, largest first: tok_embeddings (vocab 64 × dim 128 = 8,192) to fragment 0 (tie: the lowest
    # index), output (8,192) to fragment 1 (the lighter), norm (128) to fragment 0 (tie again).
    assert {n.split(".")[1] for n in by_fragment[0] if n.startswith("layers.")} == {"0", "2"}
    assert {n.split(".")[1] for n in by_fragment[1] if n.startswith("layers.")} == {"1", "3"}
    assert [n for n in by_fragment[0] if not n.startswith("layers.")] == [
        "tok_embeddings.weight",
        "norm.weight",
    ]
    assert [n for n in by_fragment[1] if not n.startswith("layers.")] == ["output.weight"]
    assert plan.fragment_sizes() == (2 * 213_248 + 8_192 + 128, 2 * 213_248 + 8_192)
    every = sorted(i for members in plan.fragments for i in members)
    assert every == list(range(len(names)))  # each parameter in exactly one fragment
    assert all(list(members) == sorted(members) for members in plan.fragments)
    assert fragment_plan(names, sizes, 1).fragments == (tuple(range(len(names))),)


@pytest.mark.timeout(60)
def test_the_plan_balances_tinys_six_blocks_over_four_fragments_parameter_by_parameter() -> None:
    """tiny: 6 layers of 1,770,240 numbers (wq/wk/wv/wo 147,456, w1/w3/w2 393,216, two norms 384),
    embeddings and head 99,840 each, final norm 384. Layers 0–3 strided whole (1,770,240 each); the
    rest largest first into the lightest fragment (ties: the lowest index), by hand:
    w1/w3/w2 of layers 4 and 5 → 0, 1, 2, 3, 0, 1 (0, 1: 2,556,672; 2, 3: 2,163,456);
    wq/wk/wv/wo of 4 then 5 → 2, 3, 2, 3, 2, 3, 0, 1 (0, 1: 2,704,128; 2, 3: 2,605,824);
    tok_embeddings → 2, output → 3 (2,705,664); the norms (layer 4's two, layer 5's two, the final)
    → 0, 1, 0, 1, 0. The rule before put 3,640,320 / 3,640,704 / 1,770,240 / 1,770,240 numbers
    in them (the largest 0.336 of the model)."""
    names, sizes = _names_and_sizes(GPT(model_config("tiny")))
    plan = fragment_plan(names, sizes, 4)
    expected = [
        ["layers.0.*", "layers.4.attention_norm", "layers.4.feed_forward.w1", "layers.5.attention_norm",
         "layers.5.attention.wv", "layers.5.feed_forward.w3", "norm"],
        ["layers.1.*", "layers.4.ffn_norm", "layers.4.feed_forward.w3", "layers.5.attention.wo",
         "layers.5.ffn_norm", "layers.5.feed_forward.w2"],
        ["tok_embeddings", "layers.2.*", "layers.4.attention.wq", "layers.4.attention.wv",
         "layers.4.feed_forward.w2", "layers.5.attention.wq"],
        ["layers.3.*", "layers.4.attention.wk", "layers.4.attention.wo", "layers.5.attention.wk",
         "layers.5.feed_forward.w1", "output"],
    ]  # fmt: skip
    for members, patterns in zip(plan.fragments, expected, strict=True):
        held = [names[i] for i in members]
        wanted = [
            n for n in names
            if any(n.startswith(p[:-1]) if p.endswith("*") else n == f"{p}.weight" for p in patterns)
        ]  # fmt: skip
        assert held == wanted
    assert plan.fragment_sizes() == (2_705_280, 2_704_896, 2_705_664, 2_705_664)
    assert sum(plan.fragment_sizes()) == 10_821_504
    assert (
        "fragment 2 (2,705,664 numbers): tok_embeddings.weight, layers.2, layers.4.attention.wq.weight"
        in (plan.describe())
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("preset", ["nano", "tiny"])
def test_every_fragment_count_up_to_the_number_of_parameters_gives_a_balanced_plan(preset: str) -> None:
    """F from 1 to the number of parameters: every parameter in exactly one fragment, none empty, and
    (blocks of equal size) no fragment above 1/F of the model by more than its largest parameter."""
    names, sizes = _names_and_sizes(GPT(model_config(preset)))
    total = sum(sizes)
    for num_fragments in range(1, len(names) + 1):
        plan = fragment_plan(names, sizes, num_fragments)
        assert plan.num_fragments == num_fragments
        assert sorted(i for members in plan.fragments for i in members) == list(range(len(names)))
        assert all(members for members in plan.fragments)
        assert max(plan.fragment_sizes()) <= total / num_fragments + max(sizes)
    with pytest.raises(ValueError, match=f"at most {len(names)}"):
        fragment_plan(names, sizes, len(names) + 1)


@pytest.mark.timeout(60)
def test_the_plan_of_a_model_without_blocks_strides_its_parameters_then_balances_the_rest() -> None:
    names, sizes = ["a.weight", "a.bias", "b.weight"], [6, 2, 4]
    # one block per parameter: 0 → fragment 0 (6), 1 → fragment 1 (2); then b.weight to the lighter, 1.
    assert fragment_plan(names, sizes, 2).fragments == ((0,), (1, 2))
    assert fragment_plan(names, sizes, 3).fragments == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="3 parameters: at most 3"):
        fragment_plan(names, sizes, 4)
    with pytest.raises(ValueError, match="sizes"):
        fragment_plan(names, sizes[:2], 2)


def test_each_fragment_rounds_every_h_steps_at_its_offset() -> None:
    assert [s for s in range(1, 25) if due_fragments(s, inner_steps=8, num_fragments=1)] == [8, 16, 24]
    assert [fragment_offset(f, inner_steps=8, num_fragments=4) for f in range(4)] == [0, 2, 4, 6]
    due = {s: due_fragments(s, inner_steps=8, num_fragments=4) for s in range(1, 17)}
    assert {s: f for s, f in due.items() if f} == {
        2: [1],
        4: [2],
        6: [3],
        8: [0],
        10: [1],
        12: [2],
        14: [3],
        16: [0],
    }


def _train(model: nn.Module, generator: torch.Generator) -> None:
    """A stand-in for inner steps: every parameter moves by a seeded random amount."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2)


def test_one_fragment_without_overlap_or_mix_is_plain_diloco_bit_for_bit() -> None:
    plain_model, fragmented_model = _gpt(), _gpt()
    plain = DiLoCo(plain_model, outer_lr=0.7, outer_momentum=0.9)
    fragmented = FragmentedDiLoCo(
        fragmented_model, model_fragment_plan(fragmented_model, 1), outer_lr=0.7, outer_momentum=0.9
    )
    plain_gen, fragmented_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(3):
        _train(plain_model, plain_gen)
        _train(fragmented_model, fragmented_gen)
        delta = plain.pseudo_gradient()
        assert torch.equal(fragmented.pseudo_gradient(0), delta)
        mean = delta * 0.5  # a "swarm mean" both take
        plain.outer_step(mean.clone())
        fragmented.land(0, mean.clone(), mix=0.0)
        assert torch.equal(fragmented.global_params(), plain.global_params)
        assert torch.equal(
            flatten_params(list(fragmented_model.parameters()), device="cpu"), plain.global_params
        )


def test_a_landed_fragment_steps_its_global_params_and_mixes_only_its_own_local_params() -> None:
    model = _gpt()
    plan = model_fragment_plan(model, 2)
    fragmented = FragmentedDiLoCo(model, plan, outer_lr=0.5, outer_momentum=0.0)  # plain SGD: hand-computable
    start = flatten_params(list(model.parameters()), device="cpu")
    _train(model, torch.Generator().manual_seed(2))
    trained = flatten_params(list(model.parameters()), device="cpu")
    sizes = [p.numel() for p in model.parameters()]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in plan.fragments[1]])
    delta = fragmented.pseudo_gradient(1)
    assert torch.equal(delta, start[index] - trained[index])
    mean = torch.full_like(delta, 0.25)
    fragmented.land(1, mean, mix=0.5)
    new_global = start[index] - 0.5 * 0.25  # SGD: θ − lr·Δ̄
    expected = start.clone()
    expected[index] = new_global
    torch.testing.assert_close(fragmented.global_params(), expected, rtol=0, atol=1e-7)
    now = flatten_params(list(model.parameters()), device="cpu")
    torch.testing.assert_close(now[index], 0.5 * trained[index] + 0.5 * new_global, rtol=0, atol=1e-6)
    other = torch.ones_like(now, dtype=torch.bool)
    other[index] = False
    assert torch.equal(now[other], trained[other])  # fragment 0 untouched: its round did not come
    with pytest.raises(ValueError, match="mix"):
        fragmented.land(1, mean, mix=1.0)


def test_a_fragment_stepped_on_copies_of_the_whole_state_is_the_landed_fragment_bit_for_bit() -> None:
    """``FragmentedOuterState.stepped`` (what a node behind steps each missed fragment round with)
    gives the whole params and momentum a member's own fragment step gives, and leaves the state
    it was asked about untouched: three rounds of two fragments, Nesterov momentum."""
    member_model, behind_model = _gpt(), _gpt()
    member = FragmentedDiLoCo(
        member_model, model_fragment_plan(member_model, 2), outer_lr=0.7, outer_momentum=0.9
    )
    behind = FragmentedDiLoCo(
        behind_model, model_fragment_plan(behind_model, 2), outer_lr=0.7, outer_momentum=0.9
    )
    generator = torch.Generator().manual_seed(3)
    start = (behind.outer.params(), behind.outer.momentum())
    held = (start[0].clone(), start[1].clone() if start[1] is not None else None)
    for round in (1, 2, 3):
        fragment = round % 2
        _train(member_model, generator)
        mean = member.pseudo_gradient(fragment) * 0.5
        other = 1 - fragment
        before_other = member.outer.fragment(other).params().clone()
        member.land(fragment, mean.clone(), mix=0.0)
        start = behind.outer.stepped(fragment, mean.clone(), start)
        assert torch.equal(start[0], member.outer.params())
        assert start[1] is not None and torch.equal(start[1], member.outer.momentum())
        assert torch.equal(member.outer.fragment(other).params(), before_other)  # only its own fragment
    assert torch.equal(behind.outer.params(), held[0])  # on copies: behind's own state untouched
    with pytest.raises(ValueError, match="numbers"):
        behind.outer.stepped(0, torch.zeros(3), start)


def test_the_whole_hash_is_fed_the_fragments_in_place_and_equals_a_flat_states() -> None:
    """The param_hash with fragments is the SHA-256 of the whole canonical vector (hashlib's, over the
    bytes of the model's flat params), yet no whole vector is put together for it: a round in flight
    holds only its fragment's extra copies (issue 32, item 3)."""
    model = _gpt()
    fragmented = FragmentedDiLoCo(model, model_fragment_plan(model, 4))
    flat = flatten_params(list(model.parameters()), device="cpu")
    expected = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    whole_views = fragmented.outer.params

    def no_whole_copy() -> torch.Tensor:
        raise AssertionError("the hash put the whole vector together")

    fragmented.outer.params = no_whole_copy  # type: ignore[method-assign]
    assert fragmented.outer.hash() == expected
    fragmented.land(2, torch.full((fragmented.num_elements(2),), 0.1), mix=0.0)  # a new version of fragment 2
    fragmented.outer.params = whole_views  # type: ignore[method-assign]
    stepped = hashlib.sha256(fragmented.global_params().numpy().tobytes()).hexdigest()
    fragmented.outer.params = no_whole_copy  # type: ignore[method-assign]
    assert stepped != expected and fragmented.outer.hash() == stepped


def test_the_host_copy_of_a_fragmented_state_is_made_once_per_version_of_each_fragment() -> None:
    """The served snapshot, the checkpoint and the eval share one host copy per version with fragments
    too, made per fragment: a round steps one fragment and copies only it (the other fragments' copies
    are the previous version's tensors); the whole vectors are put together only when asked for."""
    model = _gpt()
    fragmented = FragmentedDiLoCo(model, model_fragment_plan(model, 4))
    host = HostCopies(fragmented.diloco)
    first = host.get()
    assert host.get() is first and host.num_copies == 1 and host.num_fragment_copies == 4
    assert first.fragments is not None and len(first.fragments.params) == 4
    assert torch.equal(first.params, fragmented.global_params())
    fragmented.land(1, torch.full((fragmented.num_elements(1),), 0.1), mix=0.0)
    second = host.get()
    assert host.num_copies == 2 and host.num_fragment_copies == 5  # fragment 1's alone
    assert second.fragments is not None
    pairs = zip(first.fragments.params, second.fragments.params, strict=True)
    shared = [a.data_ptr() == b.data_ptr() for a, b in pairs]
    assert shared == [True, False, True, True]
    assert torch.equal(second.fragments.params[1], fragmented.outer.fragment(1).global_params)
    assert torch.equal(second.params, fragmented.global_params())
    assert second.param_hash == tensor_hash(fragmented.global_params())
    assert not torch.equal(second.params, first.params)  # the older copy kept its round's values
    momentum = fragmented.outer.momentum()
    assert momentum is not None and second.momentum is not None and torch.equal(second.momentum, momentum)
    assert second.fragments.momentum_sha256 == hashlib.sha256(momentum.numpy().tobytes()).hexdigest()
