from __future__ import annotations

import typing
from pathlib import Path

import pytest

from robustrl.contracts.errors import InvalidArgument
from robustrl.contracts.jobspec import TrainerSpec, apply_overrides, parse_spec, validate_job_id
from robustrl.weights.checksums import CHECKSUM_ALGORITHMS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic-grpo.yaml"


def test_example_spec_is_valid_and_defaults_fill_in() -> None:
    spec = parse_spec(EXAMPLE.read_text())
    assert spec.name == "arithmetic-grpo"
    assert spec.rollout.replicas == 2
    assert spec.recovery.mode == "role_based"


def test_overrides_set_nested_values_parsed_as_yaml() -> None:
    spec = parse_spec("name: a\n", ["trainer.lr=1e-5", "rollout.replicas=3", "trainer.steps=7"])
    assert spec.trainer.lr == pytest.approx(1e-5)
    assert spec.rollout.replicas == 3
    assert spec.trainer.steps == 7


def test_long_tail_is_off_by_default_and_set_by_overrides() -> None:
    default = parse_spec("name: a\n").rollout
    assert (default.long_tail_every, default.long_tail_factor) == (0, 20)
    spec = parse_spec("name: a\n", ["rollout.long_tail_every=5", "rollout.long_tail_factor=3"])
    assert (spec.rollout.long_tail_every, spec.rollout.long_tail_factor) == (5, 3)


def test_overrides_do_not_mutate_the_input() -> None:
    data = {"name": "a", "trainer": {"lr": 0.1}}
    apply_overrides(data, ["trainer.lr=0.2"])
    assert data["trainer"] == {"lr": 0.1}


@pytest.mark.parametrize(
    ("text", "overrides", "names"),
    [
        ("name: a\ntrainer: {lr: -1}\n", [], "trainer.lr"),
        ("name: a\ntrainer: {lrr: 0.1}\n", [], "trainer.lrr: unknown field"),
        ("name: a\n", ["rollout.engine=tpu"], "rollout.engine"),
        ("name: Bad Name\n", [], "name"),
        ("trainer: {}\n", [], "name: Field required"),
        ("- a list\n", [], "YAML mapping"),
        ("name: [unclosed\n", [], "not valid YAML"),
        ("name: a\n", ["novalue"], "key.sub=value"),
        ("name: a\n", ["name.x=1"], "name is not a section"),
        ("name: a\nid: UPPER\n", [], "not a valid job id"),
        ("name: a\n", ["rollout.long_tail_every=-1"], "rollout.long_tail_every"),
        ("name: a\n", ["rollout.long_tail_factor=0"], "rollout.long_tail_factor"),
        ("name: a\n", ["rollout.long_tail_factor=2.5"], "rollout.long_tail_factor"),
        ("name: a\n", ["trainer.weight_checksum=crc32"], "trainer.weight_checksum"),
        ("name: a\n", ["trainer.weight_bucket_mib=0"], "trainer.weight_bucket_mib"),
        ("name: a\n", ["trainer.weight_bucket_mib=8192"], "trainer.weight_bucket_mib"),
        ("name: a\n", ["trainer.strategy=zero3"], "trainer.strategy"),
        ("name: a\n", ["trainer.device=tpu"], "trainer.device"),
        ("name: a\n", ["trainer.dtype=fp16"], "trainer.dtype"),
        ("name: a\n", ["trainer.dtype=bf16", "trainer.device=cpu"], "trainer.dtype: bf16"),
        (
            "name: a\n",
            ["trainer.strategy=fsdp", "trainer.kl_coef=0.1"],
            "trainer.kl_coef: the KL reference model is not sharded",
        ),
        (
            "name: a\n",
            ["trainer.strategy=fsdp", "trainer.weight_transport=grpc"],
            "trainer.weight_transport: fsdp ranks each serve their share",
        ),
    ],
)
def test_bad_specs_name_the_field(text: str, overrides: list[str], names: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_spec(text, overrides)
    assert names in info.value.message


def test_job_ids() -> None:
    assert validate_job_id("job-1") == "job-1"
    for bad in ["", "-a", "a-", "A", "a_b", "x" * 64]:
        with pytest.raises(InvalidArgument):
            validate_job_id(bad)


def test_the_spec_offers_every_checksum_the_weight_plane_knows() -> None:
    field = TrainerSpec.model_fields["weight_checksum"]
    assert set(typing.get_args(field.annotation)) == {"auto", *CHECKSUM_ALGORITHMS}
    assert field.default == "auto"
