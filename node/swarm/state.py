"""The global state a node serves and adopts: its snapshot (global params, outer momentum, counters,
data position), the round mean served beside it, and the checks a fetched state must pass before
the loop loads it (``OuterRound``'s adoption)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from node.data.batches import NODE_LANE_KEYS
from node.outer.fragments import fragment_of_round
from node.outer.seam import AdoptedState, Assemble, FragmentStepper, OuterStepper, Stepped
from node.outer.state import tensor_hash
from protocol.allreduce.allreduce import EncodedChunk
from protocol.codecs import Codec, get_codec, takes_density
from protocol.statesync.snapshot import Snapshot

if TYPE_CHECKING:
    from node.outer.host_copy import HostFragments

__all__ = ["AdoptedState"]  # defined in node/outer/seam.py (the loop loads it), checked here

GLOBAL_PARAMS = "global_params"
OUTER_MOMENTUM = "outer_momentum"
ROUND_MEAN = "round_mean"  # fp32
ROUND_MEAN_PAYLOAD = "round_mean_payload"  # the wire codec's bytes (uint8)
ROUND_MEAN_CHUNKS = "round_mean_chunks"  # int64 (offset, numbers) per encoded chunk


def round_mean_id(param_hash: str) -> str:
    """The state id of the round mean that led to the global params ``param_hash``."""
    return f"round-mean:{param_hash}"


def fragment_name(name: str, fragment: int) -> str:
    """The tensor of fragment ``fragment``'s piece of ``name`` in a state served in fragments."""
    return f"{name}.{fragment}"


def state_snapshot(
    *,
    global_params: torch.Tensor | None = None,
    outer_momentum: torch.Tensor | None = None,
    round: int,
    step: int,
    data: dict[str, Any],
    model: str,
    corpus_sha256: str,
    param_hash: str | None = None,
    copy: bool = True,
    fragments: HostFragments | None = None,
    reuse: Snapshot | None = None,
) -> Snapshot:
    """A global state as served to joiners: params, momentum, counters, data position
    (``OuterRound.snapshot`` gathers them). ``round``: the rounds the global params went through;
    ``step`` and ``data``: the inner step and data position at that round's end. ``copy=False``:
    the tensors are host copies nobody writes to (``node.outer.host_copy.HostGlobalState``), served as
    they are, with their known ``param_hash``.

    ``fragments`` (``--fragments F``, with ``param_hash``, in place of the whole vectors): served in
    pieces, ``global_params.f`` and ``outer_momentum.f`` per fragment f (its vector, as
    ``FragmentedOuterState`` holds it), so a round, which steps one fragment, makes one fragment's
    new tensors; ``reuse``: the state served before, whose hashes of the unchanged pieces stand. The
    metadata says the whole momentum's SHA-256 (the manifest has only the pieces'); a joiner puts the
    whole vectors together (:func:`served_state`) and checks them against ``param_hash``."""
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, Any] = {}
    if fragments is not None:
        if global_params is not None or outer_momentum is not None or param_hash is None:
            raise ValueError("a state served in fragments has its pieces and param_hash, not whole vectors")
        for index, piece in enumerate(fragments.params):
            tensors[fragment_name(GLOBAL_PARAMS, index)] = piece
        for index, piece in enumerate(fragments.momentum or ()):
            tensors[fragment_name(OUTER_MOMENTUM, index)] = piece
        num_elements = sum(piece.numel() for piece in fragments.params)
        extra = {"fragments": len(fragments.params), "outer_momentum_sha256": fragments.momentum_sha256}
    else:
        if global_params is None:
            raise ValueError("a state needs its global params (whole, or in fragments)")
        tensors[GLOBAL_PARAMS] = global_params.detach().to("cpu")
        if outer_momentum is not None:
            tensors[OUTER_MOMENTUM] = outer_momentum.detach().to("cpu")
        if param_hash is None:
            param_hash = tensor_hash(tensors[GLOBAL_PARAMS])
        num_elements = tensors[GLOBAL_PARAMS].numel()
    metadata = {
        "round": round,
        "step": step,
        "param_hash": param_hash,
        "model": model,
        "num_elements": num_elements,
        "corpus_sha256": corpus_sha256,
        # The lineage's shared data position, without this node's shard or spare lane: every member
        # of a round serves byte-identical metadata, so a joiner can fetch from all of them at once.
        "data": {k: v for k, v in data.items() if k not in NODE_LANE_KEYS},
        **extra,
    }
    return Snapshot(
        round_id=round,
        state_id=param_hash,
        tensors=tensors,
        metadata=json.dumps(metadata).encode(),
        copy=copy,
        reuse=reuse,
    )


def served_state(snapshot: Snapshot, assemble: Assemble | None = None) -> Stepped:
    """The whole (global params, outer momentum) a served state holds: its tensors, or, served in
    fragments, put together from its pieces by ``assemble`` (the node's fragments' layout,
    ``FragmentedOuterState.assemble``); ValueError if it is in pieces this node cannot put together."""
    if GLOBAL_PARAMS in snapshot.tensors:
        return snapshot.tensors[GLOBAL_PARAMS], snapshot.tensors.get(OUTER_MOMENTUM)
    count = _num_fragments(snapshot)
    if assemble is None:
        raise ValueError(f"the state is served in {count} fragments and this node trains the whole model")
    params = [snapshot.tensors.get(fragment_name(GLOBAL_PARAMS, f)) for f in range(count)]
    momenta = [snapshot.tensors.get(fragment_name(OUTER_MOMENTUM, f)) for f in range(count)]
    if any(piece is None for piece in params) or len(snapshot.tensors) not in (count, 2 * count):
        raise ValueError("the state's fragments are not global_params.0.. (and outer_momentum.0..)")
    for piece in [*params, *momenta]:
        if piece is not None and piece.dtype != torch.float32:
            raise ValueError("the state's fragments are not fp32")
    whole = assemble([p for p in params if p is not None])
    if all(m is None for m in momenta):
        return whole, None
    if any(m is None for m in momenta):
        raise ValueError("the state's momentum lacks fragments")
    return whole, assemble([m for m in momenta if m is not None])


def _num_fragments(snapshot: Snapshot) -> int:
    """The number of fragments a state's metadata says it is served in (ValueError if none)."""
    try:
        count = json.loads(snapshot.metadata).get("fragments")
    except (ValueError, AttributeError):
        count = None
    if type(count) is not int or count < 1:
        raise ValueError("the state has neither global_params nor a number of fragments")
    return count


def momentum_sha256(state: Snapshot) -> str | None:
    """SHA-256 (hex) of a served state's whole outer momentum; None if it has none."""
    if GLOBAL_PARAMS in state.tensors:
        return state.sha256(OUTER_MOMENTUM).hex() if OUTER_MOMENTUM in state.tensors else None
    value = json.loads(state.metadata).get("outer_momentum_sha256")
    return value if isinstance(value, str) else None


def run_identity(*, model: str, architecture: str, num_elements: int, corpus_sha256: str) -> str:
    """What a node trains, as the opaque digest its DHT record carries (``PeerRecord.identity``):
    the model's name, architecture (its shapes, as text) and size, and the data identity (the corpus
    and tokenizer's SHA-256, or an API user's ``data_id``). Nodes of different identities never share
    a round or a state; the init is not part of it: a fresh node whose round-0 params differ from the
    swarm's takes the swarm's."""
    text = f"dtnode-identity:v1\0{model}\0{architecture}\0{num_elements}\0{corpus_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class RoundMean:
    """A round's mean Δ̄ as this node stepped with it, and the state it stepped from."""

    previous: tuple[int, str]  # (round, param_hash) before the round
    mean: torch.Tensor  # (N,) fp32; with ``--fragments`` the round's fragment's numbers only
    encoded: tuple[EncodedChunk, ...] | None = None  # the codec bytes Δ̄ was decoded from, if kept
    codec: str = "none"
    block_size: int = 0
    kept_per_block: int = 0  # top-k codecs: the numbers each block sends (0: every number)
    fragment: int | None = None  # with --fragments: the fragment the round stepped (None: the whole model)


def round_mean_snapshot(state: Snapshot, round_mean: RoundMean) -> Snapshot:
    """What a member of a round serves beside its new ``state``: the round's mean Δ̄ that took the
    global params from ``round_mean.previous`` to ``state``, so a member that missed the round can
    step itself there (``caught_up_state``) instead of fetching the whole state. Served as the wire
    codec's bytes when the all-reduce kept them (int8: ~1 byte per parameter instead of the state's
    8), else as fp32 (4 bytes). With ``--fragments`` the round stepped one fragment: its mean is that
    fragment's numbers (1/F of the model's) and the metadata names the fragment; the state's
    metadata names the round and the whole param_hash it leads to, ``previous_*`` the one before.

    Every member of the round holds the same Δ̄ and the same bytes and builds the same metadata, so
    they all serve the same snapshot and a node can fetch from all of them at once.
    """
    metadata: dict[str, Any] = {
        "previous_round": round_mean.previous[0],
        "previous_param_hash": round_mean.previous[1],
        "fragment": round_mean.fragment,
        "outer_momentum_sha256": momentum_sha256(state),
        "state": json.loads(state.metadata),
    }
    if round_mean.encoded is not None:
        chunks = round_mean.encoded
        tensors = {
            ROUND_MEAN_PAYLOAD: torch.frombuffer(
                bytearray(b"".join(c.payload for c in chunks)), dtype=torch.uint8
            ),
            ROUND_MEAN_CHUNKS: torch.tensor(
                [n for c in chunks for n in (c.offset, c.num_elements)], dtype=torch.int64
            ),
        }
        metadata["codec"] = {
            "name": round_mean.codec,
            "block_size": round_mean.block_size,
            "kept_per_block": round_mean.kept_per_block,
        }
    else:
        tensors = {ROUND_MEAN: round_mean.mean.detach().to("cpu", torch.float32).contiguous()}
    return Snapshot(
        round_id=state.round_id,
        state_id=round_mean_id(state.state_id),
        tensors=tensors,
        metadata=json.dumps(metadata).encode(),
    )


def served_codec(spec: dict[str, Any]) -> Codec:
    """The codec a round-mean snapshot's metadata names (``round_mean_snapshot``): name, block size
    and, for top-k, the numbers kept per block, which the density of ``get_codec`` must give back
    exactly (ValueError if it names no codec of ours)."""
    try:
        name, block_size = str(spec.get("name")), int(spec.get("block_size") or 0)
        kept = int(spec.get("kept_per_block") or 0)
        if not takes_density(name):
            if kept:
                raise ValueError(f"{name} sends every number, not {kept} a block")
            return get_codec(name, block_size or None)
        if block_size <= 0 or not 1 <= kept <= block_size:
            raise ValueError(
                f"{name} needs a block size and 1..block_size kept a block, got {block_size}, {kept}"
            )
        codec = get_codec(name, block_size, density=kept / block_size)
        if codec.spec().kept_per_block != kept:
            raise ValueError(f"{name} cannot keep {kept} of {block_size}")
        return codec
    except (TypeError, ValueError) as error:
        raise ValueError(f"the round mean's codec is not one of ours: {error}") from None


def _fetched_mean(
    fetched: Snapshot, metadata: dict[str, Any], num_elements: int, *, fragment: int | None = None
) -> RoundMean:
    """The mean a round-mean snapshot carries, decoded and checked (ValueError if malformed):
    ``num_elements`` numbers, the model's or fragment ``fragment``'s."""
    previous = (metadata.get("previous_round"), metadata.get("previous_param_hash"))
    if ROUND_MEAN in fetched.tensors:
        mean = fetched.tensors[ROUND_MEAN]
        if mean.dtype != torch.float32 or mean.numel() != num_elements:
            raise ValueError("the round mean is not fp32 of the model's size")
        round_mean = RoundMean(previous=previous, mean=mean, fragment=fragment)  # type: ignore[arg-type]  # checked by the caller
    else:
        payload, table = fetched.tensors.get(ROUND_MEAN_PAYLOAD), fetched.tensors.get(ROUND_MEAN_CHUNKS)
        spec = metadata.get("codec")
        if payload is None or table is None or not isinstance(spec, dict):
            raise ValueError("the round mean snapshot has neither fp32 nor encoded numbers")
        if payload.dtype != torch.uint8 or table.dtype != torch.int64 or table.numel() % 2:
            raise ValueError("the round mean's payload or chunk table has the wrong type")
        codec = served_codec(spec)
        mean = torch.empty(num_elements, dtype=torch.float32)
        raw, chunks, end, position = payload.numpy().tobytes(), [], 0, 0
        for offset, size in table.view(-1, 2).tolist():
            if offset != end or size <= 0 or offset + size > num_elements:
                raise ValueError("the round mean's chunks do not tile the model's parameters")
            length = codec.encoded_num_bytes(size)
            piece = raw[position : position + length]
            codec.validate(piece, size)  # CodecError (a ValueError) if it would not decode
            codec.decode_into(piece, mean[offset : offset + size])
            chunks.append(EncodedChunk(offset, size, piece))
            end, position = offset + size, position + length
        if end != num_elements or position != len(raw):
            raise ValueError("the round mean's chunks do not cover exactly the model's parameters")
        round_mean = RoundMean(
            previous=previous,  # type: ignore[arg-type]
            mean=mean,
            encoded=tuple(chunks),
            codec=codec.name,
            block_size=codec.block_size,
            kept_per_block=codec.spec().kept_per_block,
            fragment=fragment,
        )
    if not bool(torch.isfinite(round_mean.mean).all()):
        raise ValueError("the round mean has non-finite values")
    return round_mean


def round_mean_link(fetched: Snapshot) -> tuple[tuple[int, str], tuple[int, str]]:
    """The ``(round, param_hash)`` a fetched round mean steps from, and the one it says it leads to
    (ValueError if its metadata does not say)."""
    try:
        metadata = json.loads(fetched.metadata)
        previous = (metadata["previous_round"], metadata["previous_param_hash"])
        target = (fetched.round_id, metadata["state"]["param_hash"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"round mean metadata without its rounds: {error}") from None
    for round, param_hash in (previous, target):
        if not isinstance(round, int) or not isinstance(param_hash, str):
            raise ValueError("round mean metadata with malformed rounds")
    return previous, target


def caught_up_state(
    stepper: OuterStepper,
    fetched: Snapshot,
    *,
    previous: tuple[int, str],
    target: tuple[int, str],
    start: Stepped,
    num_elements: int,
    corpus_sha256: str,
    fragment_sizes: tuple[int, ...] = (),
    fragment_stepper: FragmentStepper | None = None,
) -> AdoptedState:
    """The state ``target = (round, param_hash)`` stepped to from ``start`` (the global params and
    outer momentum of ``previous``) with the round mean ``fetched`` (``round_mean_snapshot``);
    ValueError unless the step reproduces the target's global params and outer momentum bit for
    bit. Everything in ``fetched`` came from a peer: each field is checked before use.

    With ``--fragments`` (``fragment_sizes``) the round stepped one fragment, the one its index names
    (``fragment_of_round``): the mean must name that fragment and hold its numbers, and
    ``fragment_stepper`` steps that fragment of the whole state (the whole param_hash and momentum
    after it are checked as above, so the fragment's hash is the members' too)."""
    stepped_from, _ = round_mean_link(fetched)
    metadata = json.loads(fetched.metadata)
    if not isinstance(metadata.get("state"), dict):
        raise ValueError("round mean metadata without the state's")
    if stepped_from != previous:
        raise ValueError(
            f"the round mean follows another state than ours ({previous[0]}, {previous[1][:12]})"
        )
    if target[0] != previous[0] + 1:
        raise ValueError(f"a round mean steps one round, not {previous[0]} to {target[0]}")
    state_metadata = _checked_metadata(
        metadata["state"], num_elements=num_elements, corpus_sha256=corpus_sha256
    )
    fragment = metadata.get("fragment")
    if fragment_sizes:
        expected = fragment_of_round(target[0], len(fragment_sizes))
        if type(fragment) is not int or fragment != expected or fragment_stepper is None:
            raise ValueError(f"round {target[0]}'s mean is not fragment {expected}'s (it names {fragment!r})")
        round_mean = _fetched_mean(fetched, metadata, fragment_sizes[fragment], fragment=fragment)
        params, momentum = fragment_stepper(fragment, round_mean.mean, start)
    else:
        if fragment is not None:
            raise ValueError(
                f"the round mean is fragment {fragment!r}'s, and our rounds step the whole model"
            )
        round_mean = _fetched_mean(fetched, metadata, num_elements)
        params, momentum = stepper(round_mean.mean, start)
    if tensor_hash(params) != target[1]:
        raise ValueError("stepping with the round mean does not give the swarm's param_hash")
    momentum_sha256 = (
        None if momentum is None else hashlib.sha256(momentum.cpu().numpy().tobytes()).hexdigest()
    )
    if momentum_sha256 != metadata.get("outer_momentum_sha256"):
        raise ValueError("stepping with the round mean does not give the swarm's outer momentum")
    return AdoptedState(
        round=target[0],
        param_hash=target[1],
        global_params=params.cpu(),
        outer_momentum=None if momentum is None else momentum.cpu(),
        metadata=state_metadata,
        round_mean=round_mean,
    )


def _checked_metadata(metadata: object, *, num_elements: int, corpus_sha256: str) -> dict[str, Any]:
    """A state's metadata, checked against this node's model and corpus (ValueError if it does not fit)."""
    if not isinstance(metadata, dict):
        raise ValueError("snapshot metadata is not a JSON object")
    if metadata.get("num_elements") != num_elements:
        raise ValueError(
            f"the swarm trains a model of {metadata.get('num_elements')} parameters ({metadata.get('model')!r}), "
            f"this node {num_elements}: use the swarm's --model and --seq-len"
        )
    if metadata.get("corpus_sha256") != corpus_sha256:
        raise ValueError("the swarm trains on another corpus: use the swarm's --data and --tokenizer")
    return metadata


def adopted_state(
    snapshot: Snapshot, *, num_elements: int, corpus_sha256: str, assemble: Assemble | None = None
) -> AdoptedState:
    """Check a fetched snapshot against this node's model and corpus; ValueError if it does not fit.
    ``assemble``: with ``--fragments``, how this node puts a state served in fragments together
    (:func:`served_state`)."""
    metadata = _checked_metadata(
        json.loads(snapshot.metadata), num_elements=num_elements, corpus_sha256=corpus_sha256
    )
    params, momentum = served_state(snapshot, assemble)
    if params.dtype != torch.float32 or params.numel() != num_elements:
        raise ValueError("snapshot global_params are not fp32 of the model's size")
    if momentum is not None and (momentum.dtype != torch.float32 or momentum.numel() != num_elements):
        raise ValueError("snapshot outer_momentum is not fp32 of the model's size")
    return AdoptedState(
        round=snapshot.round_id,
        param_hash=snapshot.state_id,
        global_params=params,
        outer_momentum=momentum,
        metadata=metadata,
    )
