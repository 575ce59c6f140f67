"""A Hugging Face directory inside the trust model (issue 57 item 6, docs/security.md): remote-code pointers are never
imported, a chat template cannot reach Python's internals, every file is the directory's own (no link out of it), and
a header or config.json with absurd sizes is refused before anything of that size is allocated. Each attack is
replayed here and its refusal is one line."""

from __future__ import annotations

import json
import os
import struct

import pytest

from hf_helpers import llama_dir
from plait.errors import PlaitError
from plait.serve.model.load import ModelRef, load_model

pytest.importorskip("transformers")


@pytest.fixture
def hf(tmp_path):
    return llama_dir(tmp_path / "llama")


def edit_config(d, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | fields))


def refusal(d) -> str:
    with pytest.raises(PlaitError) as e:
        load_model(ModelRef(str(d)))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_remote_code_named_by_auto_map_is_never_imported(hf, tmp_path):
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'w').close()\nclass Evil: pass\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (hf / name).write_text(code)
    edit_config(hf, auto_map={"AutoConfig": "configuration_evil.Evil", "AutoModelForCausalLM": "modeling_evil.Evil"})
    served = load_model(ModelRef(str(hf)))  # a Llama: plait builds its own
    assert served.registry_name == "llama" and not marker.exists()
    edit_config(hf, architectures=["EvilForCausalLM"], model_type="evil")
    assert refusal(hf).startswith(f"plait serve '{hf}': architecture 'EvilForCausalLM' is not supported; plait loads ")
    assert not marker.exists()


def test_a_chat_template_that_reaches_for_globals_runs_nothing(hf, tmp_path):
    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    httpx = pytest.importorskip("httpx")
    marker = tmp_path / "owned"
    attack = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": attack}))
    with ServerThread(hf, ServeOptions(name="m", block_size=8, kv_cache_mb=1)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                            "content": "hi"}]})
    assert r.status_code == 400 and not marker.exists()
    message = r.json()["error"]["message"]
    assert message.startswith("the model's chat template refused the conversation: ") and "unsafe" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_file_that_links_out_of_the_directory_is_refused(hf, tmp_path, name):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(hf / name, outside / name)
    (hf / name).symlink_to(outside / name)
    assert refusal(hf) == (f"plait serve '{hf}': {name} is a link to a file outside the directory "
                           f"({outside / name}); a model directory's files must be its own: copy the file in")


def test_a_safetensors_header_with_absurd_shapes_is_refused_unread(hf):
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [10**12, 10**12],
                                                       "data_offsets": [0, 16]}}).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert refusal(hf).startswith(f"plait serve '{hf}': model.safetensors is not a readable safetensors file")


@pytest.mark.parametrize("fields, start", [
    ({"hidden_size": 1 << 20, "head_dim": 1 << 18, "intermediate_size": 1 << 22}, "config.json makes tok_emb.weight ["),
    ({"vocab_size": 10**11}, "config.json's vocab_size = 100000000000 but the weights' token embedding has "),
    ({"intermediate_size": 1 << 30}, "config.json makes blocks.0.mlp.gate_proj.weight ["),
])
def test_config_sizes_that_are_not_the_weights_are_refused_before_allocation(hf, fields, start):
    import resource

    edit_config(hf, **fields)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = refusal(hf)
    assert message.startswith(f"plait serve '{hf}': {start}")
    assert message.endswith("; config.json does not describe these weights")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB: nothing of that size was made


def test_layers_config_json_names_beyond_the_weights_are_refused(hf):
    edit_config(hf, num_hidden_layers=10**6)
    assert "tensor model.layers.2." in refusal(hf)
