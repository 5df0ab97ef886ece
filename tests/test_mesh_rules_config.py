"""Mesh flags, rules files and config loading: the happy paths and each way they can be wrong."""

import pytest

from spmd.assembly.config import load_config
from spmd.core.errors import UserError
from spmd.core.mesh import MESH_AXES, build_mesh, parse_mesh
from spmd.core.rules import load_rules, presets, rules_table, validate


def test_mesh_fill_and_defaults(devices):
    mesh = build_mesh("data=2,fsdp=-1,tensor=2")
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    assert mesh.axis_names == MESH_AXES
    assert all(t.name == "Auto" for t in mesh.axis_types)
    assert dict(build_mesh("", devices=devices[:1]).shape) == dict.fromkeys(MESH_AXES, 1)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("data=4", "has 4 devices but 8 are available"),
        ("dta=8", "unknown mesh axis 'dta' in --mesh (did you mean 'data'?)"),
        ("data=-1,fsdp=-1", "at most one --mesh axis may be -1"),
        ("data=3,fsdp=-1", "cannot fill 'fsdp'"),
        ("data", "must look like AXIS=SIZE"),
        ("data=x", "must be an integer"),
        ("data=0", "must be positive or -1"),
        ("data=2,data=4", "appears twice"),
    ],
)
def test_bad_mesh(devices, spec, message):
    with pytest.raises(UserError, match=None) as e:
        build_mesh(spec)
    assert message in str(e.value)


def test_dcn_mesh_is_validated_against_process_count(devices):
    assert parse_mesh("data=2", "--dcn-mesh")["data"] == 2
    with pytest.raises(UserError, match="--dcn-mesh data=2 has 2 devices but 1 are available"):
        build_mesh("fsdp=4", "data=2")
    with pytest.raises(UserError, match="unknown mesh axis 'pipe' in --dcn-mesh"):
        build_mesh("fsdp=8", "pipe=1")


def test_presets_exist_and_map_every_name():
    assert {"dp", "fsdp", "tp", "fsdp_tp"} <= set(presets())
    for name in presets():
        assert load_rules(name).description


def test_decoding_rules_split_nothing_along_the_sequence():
    cp = load_rules("cp_ring").for_decoding()
    assert cp.mapping["seq"] == cp.mapping["act_seq"] == ()
    assert cp.mapping["batch"] == ("data", "fsdp", "context")  # context had no other job
    sp = load_rules("fsdp_tp_sp").for_decoding()
    assert sp.mapping["act_seq"] == () and "tensor" not in sp.mapping["batch"]  # tensor still splits heads
    assert load_rules("fsdp").for_decoding() == load_rules("fsdp")


def _rules_file(tmp_path, body):
    path = tmp_path / "r.toml"
    path.write_text(body)
    return str(path)


def test_rules_errors(tmp_path):
    with pytest.raises(UserError, match="unknown rules preset 'fsdpp'.*did you mean 'fsdp'"):
        load_rules("fsdpp")
    with pytest.raises(UserError, match="unknown logical axis 'embd'.*did you mean 'embed'"):
        load_rules(_rules_file(tmp_path, '[rules]\nembd = "fsdp"\n'))
    with pytest.raises(UserError, match="unknown mesh axis 'fsd'.*did you mean 'fsdp'"):
        load_rules(_rules_file(tmp_path, '[rules]\nembed = "fsd"\n'))
    with pytest.raises(UserError, match="lists a mesh axis twice"):
        load_rules(_rules_file(tmp_path, '[rules]\nbatch = ["data", "data"]\n'))
    with pytest.raises(UserError, match="not valid TOML"):
        load_rules(_rules_file(tmp_path, "[rules\n"))
    with pytest.raises(
        UserError, match="shard_optimizer_over maps to unknown mesh axis 'dta'.*did you mean 'data'"
    ):
        load_rules(_rules_file(tmp_path, 'extends = "dp"\nshard_optimizer_over = ["dta"]\n'))
    assert load_rules("dp_zero1").shard_optimizer_over == ("data", "fsdp")
    assert "shard_optimizer_over  data, fsdp" in rules_table(load_rules("dp_zero1"))


def test_a_rules_file_extends_a_preset_and_lists_only_what_differs(tmp_path):
    base = tmp_path / "mine.toml"
    base.write_text('extends = "fsdp_tp"\ndescription = "mine"\n[rules]\nvocab = []\n')
    (tmp_path / "child.toml").write_text('extends = "mine.toml"\ncontext_parallel = "ulysses"\n')
    parent, mine, child = (
        load_rules("fsdp_tp"),
        load_rules(str(base)),
        load_rules(str(tmp_path / "child.toml")),
    )
    assert mine.mapping == {**parent.mapping, "vocab": ()}
    assert mine.sources["vocab"] == str(base) and mine.sources["embed"] == "fsdp_tp"
    assert mine.sources["heads"] == "tp" and mine.sources["batch"] == "base"
    assert child.mapping == mine.mapping and child.context_parallel == "ulysses"
    assert child.description == "mine"  # inherited, like every key the file leaves out
    (tmp_path / "striped.toml").write_text('extends = "child.toml"\nload_balance = "striped"\n')
    table = rules_table(load_rules(str(tmp_path / "striped.toml")))
    assert (
        "vocab" in table
        and str(base) in table
        and "striped" in table
        and str(tmp_path / "striped.toml") in table
    )


def test_extends_errors(tmp_path):
    for name, body in {"a": 'extends = "b.toml"\n', "b": 'extends = "a.toml"\n'}.items():
        (tmp_path / f"{name}.toml").write_text(body)
    with pytest.raises(
        UserError, match=r"extend each other in a circle: .*a\.toml -> .*b\.toml -> .*a\.toml"
    ):
        load_rules(str(tmp_path / "a.toml"))
    with pytest.raises(UserError, match="extends 'fsdpp': unknown rules preset 'fsdpp'.*did you mean 'fsdp'"):
        load_rules(_rules_file(tmp_path, 'extends = "fsdpp"\n'))
    with pytest.raises(UserError, match="unknown logical axis 'embd'"):
        load_rules(_rules_file(tmp_path, 'extends = "fsdp"\n[rules]\nembd = "fsdp"\n'))
    with pytest.raises(UserError, match="needs a \\[rules\\] table"):
        load_rules(_rules_file(tmp_path, 'description = "no rules, no parent"\n'))
    # A file that maps only some names still fails where the model needs one it lacks.
    partial = load_rules(_rules_file(tmp_path, '[rules]\nbatch = "data"\n'))
    with pytest.raises(UserError, match="do not map logical axis 'embed'"):
        validate(partial, {"w": ("embed",)}, dict.fromkeys(MESH_AXES, 1))


def test_validate_names_duplicates_and_divisibility():
    rules = load_rules("fsdp_tp")
    sizes = dict.fromkeys(MESH_AXES, 1) | {"fsdp": 2, "tensor": 4}
    with pytest.raises(UserError, match="do not map logical axis 'mystery'"):
        validate(rules, {"w": ("embed", "mystery")}, sizes)
    with pytest.raises(UserError, match="use mesh axis 'fsdp' twice for w"):
        validate(rules, {"w": ("embed", "batch")}, sizes)
    with pytest.raises(
        UserError, match=r"w: dimension 1 \(mlp, size 6\) does not divide by mesh axes tensor=4 = 4"
    ):
        validate(rules, {"w": ("embed", "mlp")}, sizes, {"w": (8, 6)})
    validate(rules, {"w": ("embed", "mlp")}, sizes, {"w": (8, 12)})


def test_config_overrides_and_errors():
    cfg = load_config("tiny", ["train.steps=7", "model.tie_embeddings=true", "optimizer.learning_rate=1e-3"])
    assert (cfg.train.steps, cfg.model.tie_embeddings, cfg.optimizer.learning_rate) == (7, True, 1e-3)
    with pytest.raises(UserError, match="unknown config key 'train.stpes'.*did you mean 'train.steps'"):
        load_config("tiny", ["train.stpes=3"])
    with pytest.raises(UserError, match="--set train.steps=ten: expected an integer"):
        load_config("tiny", ["train.steps=ten"])
    with pytest.raises(UserError, match="--set model.tie_embeddings=maybe: expected true or false"):
        load_config("tiny", ["model.tie_embeddings=maybe"])
    with pytest.raises(UserError, match="unknown config 'tinny'.*did you mean 'tiny'"):
        load_config("tinny")
    with pytest.raises(UserError, match="must be a multiple of train.microbatches"):
        load_config("tiny", ["train.microbatches=3"])
    with pytest.raises(UserError, match="train.grad_reduce_dtype must be compute or float32, got 'bf16'"):
        load_config("tiny", ["train.grad_reduce_dtype=bf16"])


def test_config_file_type_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(UserError, match="train.steps must be an integer"):
        load_config(str(path))
    path.write_text("[optim]\nlr = 1\n")
    with pytest.raises(UserError, match="unknown section 'optim'"):
        load_config(str(path))


def test_a_config_saved_by_the_older_layout_reads_with_its_keys_moved():
    """Checkpoints and config.json written before the tables had owners: optimizer settings under
    [train], MoE keys under [model] (n_experts 0 for a dense model), CPU tuning under [train]."""
    from spmd.assembly.config import config_from_json

    old = {
        "name": "old",
        "model": {"d_model": 64, "n_experts": 8, "top_k": 2, "moe_every": 2, "moe_dispatch": "dropless"},
        "train": {
            "steps": 7,
            "learning_rate": 1e-3,
            "beta2": 0.9,
            "cpu_matmul": "xla",
            "host_heap": "system",
        },
        "optimizer": {"name": "lion"},
    }
    cfg = config_from_json(old)
    assert cfg.model_family.name == "llama" and cfg.train.steps == 7
    assert (cfg.optimizer.name, cfg.optimizer.learning_rate, cfg.optimizer.beta2) == ("lion", 1e-3, 0.9)
    assert (cfg.cpu.matmul, cfg.cpu.host_heap) == ("xla", "system")
    assert (cfg.model.moe.n_experts, cfg.model.moe.every, cfg.model.moe.dispatch) == (8, 2, "dropless")
    dense = config_from_json({**old, "model": {"d_model": 64, "n_experts": 0, "top_k": 2}})
    assert dense.model.moe is None
    assert config_from_json(cfg.to_json()) == cfg  # and the new layout reads back as itself
    with pytest.raises(UserError, match="has moved: it is 'optimizer.learning_rate' now"):
        load_config("tiny", ["train.learning_rate=1e-3"])


def test_the_context_parallel_keys_live_in_the_rules_and_old_configs_still_read(tmp_path):
    """[attention] left the config for the rules file: a config file or --set that names its keys
    gets an error naming the new spelling; a config saved with the table (checkpoints,
    config.json) reads as before, the table dropped (the saved run records its resolved rules)."""
    from spmd.assembly.config import config_from_json

    (tmp_path / "old.toml").write_text('[attention]\nload_balance = "striped"\n')
    with pytest.raises(UserError, match=r"load_balance = 'striped' in a rules file .*cp_ring"):
        load_config(str(tmp_path / "old.toml"))
    saved = load_config("tiny").to_json()
    old = config_from_json({**saved, "attention": {"context_parallel": "ulysses", "load_balance": ""}})
    assert old == config_from_json(saved) and "attention" not in saved
