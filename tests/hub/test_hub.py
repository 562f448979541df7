"""Publishing to the Hub, offline: the staged upload, its model card, the calls to huggingface_hub, and the CLI."""

import inspect
import json
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import documents
import numpy as np
import pytest
import safetensors.torch
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard, ModelInfo, RepoUrl, SpaceCard
from huggingface_hub.errors import RepositoryNotFoundError
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from test_pipeline_loading import fill_hub_cache
from test_vocabulary import subword_tokenizer

import diffusers_lmlp
from diffusers_lmlp import FAMILIES, LMLPPipeline
from diffusers_lmlp.hub import model as hub_model
from diffusers_lmlp.hub import push_pipeline, push_space, stage_pipeline, stage_space, write_model_card
from diffusers_lmlp.hub.__main__ import build_parser, main, program_name
from diffusers_lmlp.hub.card import GENERIC_PROMPT, block_markers
from diffusers_lmlp.hub.model import TEXT_LIMIT
from diffusers_lmlp.hub.remote_code import remote_code_files
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR, SPACE_FILE_LIMIT
from diffusers_lmlp.hub.upload import check_final_form, find_secret, looks_like_credential
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.tiny import TINY_VOCAB_WORDS, build_tiny_pipeline, tiny_clip_text_encoder, tiny_clip_tokenizer


PIPELINE_FILES = {
    "README.md",
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
}
MODEL_INFO = HfApi.model_info
HUB_TOKEN = "hf_TestTokenThatMustNeverBeUploaded"
# What a training run leaves next to the pipeline, none of which belongs on the Hub.
TRAINING_LEFTOVERS = {
    "checkpoint-100/model.safetensors": b"x",
    "checkpoint-100/optimizer.bin": b"x",
    ".checkpoint-200.tmp/model.safetensors": b"x",
    "logs/lmlp-text-to-image/events.out.tfevents.1.host": b"x",
    "logs/lmlp-text-to-image/run.json": b"{}",
    "transformer/diffusion_pytorch_model.bin": b"x",
    "optimizer.pt": b"x",
    "ema.pth": b"x",
    "model.ckpt": b"x",
    "state.pkl": b"x",
    "scratch.tmp/notes.json": b"{}",
    "__pycache__/x.json": b"{}",
}


@pytest.fixture
def saved(pipe, tmp_path) -> Path:
    """The tiny pipeline saved with `save_pretrained`, plus training leftovers that must not be uploaded."""
    folder = tmp_path / "tiny-lmlp"
    pipe.save_pretrained(folder)
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == PIPELINE_FILES - {
        "README.md"
    }
    for path, data in TRAINING_LEFTOVERS.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    return folder


@pytest.fixture
def hub_calls(monkeypatch):
    """Record the network calls of HfApi as (method, arguments bound to its real signature); `create_commit` also
    records the bytes of every file it would upload."""
    calls = []
    results = {
        "whoami": lambda arguments: {"name": "alice"},
        "create_repo": lambda arguments: RepoUrl(f"https://huggingface.co/{arguments['repo_id']}"),
        "add_space_variable": lambda arguments: {},
        # The model repo a Space serves, as `HfApi.model_info` lists it.
        "model_info": lambda arguments: ModelInfo(
            id=arguments["repo_id"], private=False, siblings=[{"rfilename": name} for name in sorted(PIPELINE_FILES)]
        ),
        "create_commit": lambda arguments: CommitInfo(
            commit_url=f"https://huggingface.co/{arguments['repo_id']}/commit/abc",
            commit_message=arguments["commit_message"],
            commit_description="",
            oid="abc",
        ),
    }

    def recorder(name):
        signature = inspect.signature(getattr(HfApi, name))

        def record(self, *args, **kwargs):
            arguments = signature.bind(self, *args, **kwargs).arguments
            del arguments["self"]
            if name == "create_commit":
                arguments["files"] = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in args[1]}
            calls.append((name, arguments))
            return results[name](arguments)

        return record

    for name in results:
        monkeypatch.setattr(HfApi, name, recorder(name))
    return calls


def card_of(folder: Path) -> ModelCard:
    return ModelCard.load(folder / "README.md")


def test_a_folder_saved_with_this_machine_s_paths_is_uploaded_without_them(saved, hub_calls, tmp_path):
    # As diffusers' own save of the components leaves it: each config names where it was loaded from.
    written = {
        "model_index.json": "stabilityai/a-base",
        "vae/config.json": "/home/alice/models/sd-vae-ft-mse",
        "transformer/config.json": str(tmp_path / "run" / "transformer"),
        "scheduler/scheduler_config.json": "/home/alice/.cache/huggingface/hub/models--a--b/snapshots/0/scheduler",
        "tokenizer/tokenizer_config.json": "/home/alice/models/clip",  # transformers < 4.27: "name_or_path"
    }
    for name, value in written.items():
        config = json.loads((saved / name).read_text())
        key = "name_or_path" if "tokenizer" in name else "_name_or_path"
        (saved / name).write_text(json.dumps({**config, key: value}, indent=2))
    before = {name: (saved / name).read_text() for name in written}

    push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    uploaded = {name: data.decode() for name, data in hub_calls[-1][1]["files"].items() if name.endswith(".json")}
    assert not [name for name, text in uploaded.items() if "/home/alice" in text or str(tmp_path) in text]
    assert json.loads(uploaded["model_index.json"])["_name_or_path"] == "stabilityai/a-base"
    for name in written:  # the rest of each config goes up as it was
        config = json.loads(before[name])
        expected = {k: v for k, v in config.items() if not (k.endswith("name_or_path") and v.startswith("/"))}
        assert json.loads(uploaded[name]) == expected, name
    assert {name: (saved / name).read_text() for name in written} == before  # the folder itself is not changed


def test_upload_leaves_out_checkpoints_logs_and_pickles(saved, tmp_path):
    staged = stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload")
    assert set(staged.files) == PIPELINE_FILES
    assert {p.relative_to(staged.folder).as_posix() for p in staged.folder.rglob("*") if p.is_file()} == PIPELINE_FILES
    left_out = ".checkpoint-200.tmp/ __pycache__/ checkpoint-100/ ema.pth logs/ model.ckpt optimizer.pt scratch.tmp/"
    assert list(staged.left_out) == [*left_out.split(), "state.pkl", "transformer/diffusion_pytorch_model.bin"]
    assert staged.left_out["checkpoint-100/"].startswith("matches 'checkpoint-*': training state")
    assert staged.left_out["optimizer.pt"].startswith("pickled (only safetensors weights are uploaded")
    assert staged.refused == {}
    assert (saved / "optimizer.pt").is_file() and not (saved / "README.md").exists()  # the source is untouched


OUTSIDE_SECRET = b"OUTSIDE-THE-FOLDER: must never be uploaded\n"
# Tokenizer files a credential rule must not catch, and one of the size of CLIP's tokenizer.json (below the limit).
LEGITIMATE = {"tokenizer/special_tokens_map.json", "tokenizer/added_tokens.json", "clip/tokenizer.json"}


HARD_LINK = (
    "a hard link (2 names for one file, which may be outside the folder); to upload it, make it a file of its own: "
    "cp FILE FILE.copy && mv FILE.copy FILE"
)


def add_hostile_files(folder: Path, outside: Path) -> dict[str, str]:
    """Add links (symbolic and hard), credential-like files, a FIFO, an oversize json and legitimate tokenizer files to
    a saved pipeline; return the refusals the upload must report."""
    outside.mkdir()
    (outside / "secret.txt").write_bytes(OUTSIDE_SECRET)
    (outside / "outside.json").write_bytes(OUTSIDE_SECRET)
    os.link(outside / "outside.json", folder / "notes.json")  # a second name for a file outside the folder
    (folder / "a.json").write_text("{}")
    os.link(folder / "a.json", folder / "b.json")  # two names inside the folder: a link all the same
    (outside / "folder").mkdir()
    (outside / "folder" / "config.json").write_bytes(b'{"outside": true}')
    (folder / "tokenizer" / "vocab.txt").symlink_to(outside / "secret.txt")  # a link to a file outside
    (folder / "passwd.txt").symlink_to("/etc/passwd")
    (folder / "extra").symlink_to(outside / "folder", target_is_directory=True)  # a link to a folder outside
    (folder / "tokenizer" / "copy.json").symlink_to("tokenizer.json")  # a link inside the folder: refused too
    (folder / "up.json").symlink_to("../outside/secret.txt")  # a relative `..` link
    (folder / "token.txt").write_text("hf_abc")
    (folder / "secrets.json").write_text('{"api_key": "abc"}')
    (folder / ".env").write_text("HF_TOKEN=hf_abc")
    (folder / "credentials").mkdir()
    (folder / "credentials" / "hub.json").write_text('{"token": "hf_abc"}')
    os.mkfifo(folder / "pipe.json")  # copying a FIFO would block or fail
    (folder / "big.json").write_bytes(b" " * (TEXT_LIMIT[0] + 1))
    (folder / "limit.json").write_bytes(b" " * TEXT_LIMIT[0])  # exactly at the limit: uploaded
    special_tokens = LMLPPipeline.from_pretrained(folder).tokenizer.special_tokens_map
    (folder / "tokenizer" / "special_tokens_map.json").write_text(json.dumps(special_tokens))
    (folder / "tokenizer" / "added_tokens.json").write_text("{}")
    (folder / "clip").mkdir()
    (folder / "clip" / "tokenizer.json").write_bytes(b" " * 3_642_074)
    refused = {
        "a.json": HARD_LINK,
        "b.json": HARD_LINK,
        "notes.json": HARD_LINK,
        "big.json": "16,000,001 bytes, over the limit of 16,000,000 bytes for .json, .txt and .md files",
        "credentials/": "the name looks like a credential",
        "extra/": f"a symbolic link to a folder, {outside / 'folder'}; links are never followed",
        "passwd.txt": "a symbolic link to /etc/passwd; links are never followed",
        "pipe.json": "not a regular file (a FIFO, socket or device)",
        "secrets.json": "the name looks like a credential",
        "token.txt": "the name looks like a credential",
        "tokenizer/copy.json": "a symbolic link to tokenizer.json; links are never followed",
        "tokenizer/vocab.txt": f"a symbolic link to {outside / 'secret.txt'}; links are never followed",
        "up.json": "a symbolic link to ../outside/secret.txt; links are never followed",
    }
    return dict(sorted(refused.items()))


@pytest.mark.slow
def test_links_credentials_and_oversize_files_are_refused_by_the_dry_run_and_the_push(
    saved, hub_calls, generate, tmp_path, capsys, caplog
):
    refused = add_hostile_files(saved, tmp_path / "outside")
    expected_files = PIPELINE_FILES | LEGITIMATE | {"limit.json"}

    main(["push", str(saved), "alice/tiny-lmlp", "--dry-run", "--output-dir", str(tmp_path / "upload")])
    dry_run = capsys.readouterr().out
    staged = {p.relative_to(tmp_path / "upload").as_posix() for p in (tmp_path / "upload").rglob("*")}
    assert {path for path in staged if (tmp_path / "upload" / path).is_file()} == expected_files
    assert not any((tmp_path / "upload" / path).is_symlink() for path in staged)
    report = "Refused, never uploaded:\n" + "".join(f"  {path}: {reason}\n" for path, reason in refused.items())
    assert report in dry_run
    assert "Left out, not part of the upload:\n" in dry_run and "  .env: a hidden file\n" in dry_run

    main(["push", str(saved), "alice/tiny-lmlp", "--token", HUB_TOKEN])
    files = hub_calls[-1][1]["files"]
    assert set(files) == expected_files
    assert not [path for path, data in files.items() if OUTSIDE_SECRET in data or b"root:" in data]
    assert not [path for path, data in files.items() if HUB_TOKEN.encode() in data or b"hf_abc" in data]
    # The real push logs the same report, as a warning.
    assert report in caplog.text and "  .env: a hidden file\n" in caplog.text
    assert [r.levelname for r in caplog.records if r.name == "diffusers_lmlp.hub.upload"] == ["WARNING"]
    # What goes up still loads and generates the source's image.
    assert torch.equal(
        generate(LMLPPipeline.from_pretrained(tmp_path / "upload")), generate(LMLPPipeline.from_pretrained(saved))
    )


def test_a_refused_file_the_pipeline_needs_stops_the_upload(saved, hub_calls, tmp_path):
    outside = tmp_path / "tokenizer.json"
    (saved / "tokenizer" / "tokenizer.json").rename(outside)
    (saved / "tokenizer" / "tokenizer.json").symlink_to(outside)
    message = (
        r"Without the files refused for upload \(tokenizer/tokenizer.json: a symbolic link to .*\), the uploaded "
    )
    # The staged folder would lack the tokenizer's file: loading it refuses the empty tokenizer transformers builds.
    fails = "loading it fails with ValueError: The tokenizer folder .* has neither tokenizer.json nor vocab.json"
    with pytest.raises(ValueError, match=message + "pipeline would not work: " + fails):
        push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    assert hub_calls == []  # nothing was created or committed


CREDENTIALS = """
token.txt HF_TOKEN hf_token.json hfToken.txt access-token.json secrets.json my_secret.txt password.txt
credentials.json git-credential .env prod.env .env.local id_rsa id_ed25519.pub .netrc server.pem tls.key
api_key.json apiKey.txt APIKey.txt aws_access_key.txt service-account.json cookies.txt .pypirc mytoken.txt
HFTOKEN.txt api_keys.txt auth.json oauth.json githubtoken dbpassword.txt myapikeys.json access_keys.csv
""".split()
NOT_CREDENTIALS = """
tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json vocab.json vocab.txt merges.txt
model_index.json config.json scheduler_config.json samples.png diffusion_pytorch_model.safetensors
training_summary.json README.md environment.json keyframes.json monkey.png tokens.txt tokenizer_2
detokenizer.json tokens_map.json venv author.json authors.txt fortunecookie.png
""".split()


@pytest.mark.parametrize("name", CREDENTIALS + NOT_CREDENTIALS)
def test_credential_like_names_are_recognised_and_pipeline_files_are_not(name):
    assert looks_like_credential(name) == (name in CREDENTIALS)


def fake_secrets() -> dict[str, str]:
    """A made-up secret of every kind, by its name in the report (assembled, so no scanner takes this file for one)."""
    word = "AbCd1234"
    return {
        "a Hugging Face token (hf_...)": "hf_" + word * 5,
        "a Hugging Face organization token (api_org_...)": "api_org_" + word * 4,
        "an AWS access key id (AKIA...)": "AKIA" + "ABCD2345" * 2,
        "a GitHub token (ghp_...)": "ghp_" + word * 5,
        "a GitHub token (github_pat_...)": "github_pat_" + "11ABCDEFG0_" + word * 6,
        "an OpenAI API key (sk-...)": "sk-proj-" + word * 3 + "T3Blbk" + "FJ" + word * 3,
        "an Anthropic API key (sk-ant-...)": "sk-ant-api03-" + word * 6,
        "a Google API key (AIza...)": "AIza" + word * 4 + "xyz",
        "a Slack token (xox...)": "xoxb-" + "123456789012-" + word * 3,
        "a private key (-----BEGIN ... PRIVATE KEY-----)": "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3Bl\n",
    }


@pytest.mark.parametrize("kind", list(fake_secrets()))
def test_each_kind_of_secret_is_found_and_named_without_showing_it(kind, tmp_path):
    secret = fake_secrets()[kind]
    (tmp_path / "notes.txt").write_text(f"run notes\nthe key: {secret}\n")
    reason = find_secret(tmp_path / "notes.txt")
    assert reason == (
        f"holds {kind} on line 2: remove it from the file (and revoke it, if it was ever shared); the secret is not "
        "shown here"
    )
    # Glued to a longer word, or cut short, it is no secret of that format.
    (tmp_path / "word.txt").write_text(f"x{secret}")
    (tmp_path / "short.txt").write_text(secret[: len(secret) // 2])
    assert find_secret(tmp_path / "word.txt") is None or "PRIVATE KEY" in kind
    assert find_secret(tmp_path / "short.txt") is None


@pytest.mark.parametrize(
    "text",
    ["-----BEGIN PUBLIC KEY-----", "-----BEGIN CERTIFICATE-----", "hf_hub_download", "HF_TOKEN=", "sk-" + "a" * 60,
     "AKIA" + "ABCD2345" * 3, "ghp_short", "api_org_", "the token is set in the Space's settings"],
)  # fmt: skip
def test_text_that_only_resembles_a_secret_is_not_taken_for_one(text, tmp_path):
    (tmp_path / "notes.txt").write_text(f"{text}\n")
    assert find_secret(tmp_path / "notes.txt") is None


@pytest.mark.slow
def test_tokenizer_vocabularies_and_shipped_files_are_not_taken_for_secrets(pipe, tmp_path):
    # A CLIP-layout vocabulary of the docs' English words, saved both ways CLIP tokenizers are saved.
    words = tuple(sorted(set(re.findall(r"[a-z]{2,}", documents.texts().lower()))))
    assert len(words) > 1000
    clip = tmp_path / "clip"
    tiny_clip_tokenizer(77, clip, words=words).save_pretrained(clip)
    (clip / "special_tokens_map.json").write_text(json.dumps(pipe.tokenizer.special_tokens_map))
    (clip / "added_tokens.json").write_text("{}")
    assert {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in clip.iterdir()}
    pipe.save_pretrained(tmp_path / "tiny")
    files = [
        *clip.iterdir(),
        *(tmp_path / "tiny").rglob("*"),  # the tiny pipeline's tokenizer, configs and weights' headers
        *PIPELINE_PATH.rglob("*"),  # the shipped shapes pipeline
        *DEFAULT_SPACE_DIR.iterdir(),
    ]
    found = {str(path): find_secret(path) for path in files if path.is_file()}
    assert len(found) > 20 and not {path: reason for path, reason in found.items() if reason}
    # The code --with-code generates from the package.
    code, _ = remote_code_files(json.loads((PIPELINE_PATH / "model_index.json").read_text()))
    for path, text in code.items():
        (tmp_path / path.replace("/", "_")).write_text(text)
        assert find_secret(tmp_path / path.replace("/", "_")) is None, path


def test_a_secret_in_a_harmless_named_file_or_a_name_is_refused_and_shown_nowhere(
    saved, hub_calls, tmp_path, capsys, caplog
):
    secrets = fake_secrets()
    hf_token, aws_key = secrets["a Hugging Face token (hf_...)"], secrets["an AWS access key id (AKIA...)"]
    (saved / "notes.txt").write_text(f"run notes\nHF_TOKEN={hf_token}\n")
    (saved / "extra").mkdir()
    (saved / "extra" / "settings.json").write_text(json.dumps({"aws_key": aws_key}, indent=1))
    png_with_text(saved / "samples.png", f"trained with --hub_token {hf_token}", "zTXt")
    (saved / f"notes-{hf_token}.txt").write_text("harmless")
    refused = {
        "extra/settings.json": "holds an AWS access key id (AKIA...) on line 2: remove it from the file",
        "notes-<secret>.txt": "its name holds a secret (not shown here): rename it",
        "notes.txt": "holds a Hugging Face token (hf_...) on line 2: remove it from the file",
        "samples.png": "holds a Hugging Face token (hf_...) in its image text chunks",
    }

    main(["push", str(saved), "alice/tiny-lmlp", "--dry-run", "--output-dir", str(tmp_path / "upload")])
    dry_run = capsys.readouterr()
    for path, reason in refused.items():
        assert f"  {path}: {reason}" in dry_run.out
    assert {
        p.relative_to(tmp_path / "upload").as_posix() for p in (tmp_path / "upload").rglob("*.*")
    } == PIPELINE_FILES
    main(["push", str(saved), "alice/tiny-lmlp", "--token", HUB_TOKEN])
    files = hub_calls[-1][1]["files"]
    assert set(files) == PIPELINE_FILES
    assert "  notes.txt: holds a Hugging Face token (hf_...) on line 2" in caplog.text
    shown = dry_run.out + dry_run.err + capsys.readouterr().out + caplog.text + str(list(files.values()))
    assert hf_token not in shown and aws_key not in shown and hf_token[3:20] not in shown


def png_with_text(path: Path, text: str, chunk: str) -> None:
    """A PNG whose text chunk `chunk` ("tEXt", or compressed "zTXt" or "iTXt") holds `text`."""
    info = PngInfo()
    if chunk == "iTXt":
        info.add_itxt("Comment", text, zip=True)
    else:
        info.add_text("Comment", text, zip=chunk == "zTXt")
    Image.new("RGB", (4, 4)).save(path, pnginfo=info)
    assert chunk.encode() in path.read_bytes() and (chunk == "tEXt" or text.encode() not in path.read_bytes())


ENCODED_FORMS = {
    "zTXt": ("samples.png", lambda path, secret: png_with_text(path, secret, "zTXt"), "in its image text chunks"),
    "iTXt": ("samples.png", lambda path, secret: png_with_text(path, secret, "iTXt"), "in its image text chunks"),
    "UTF-16": ("notes.txt", lambda path, secret: path.write_text(f"HF_TOKEN={secret}\n", encoding="utf-16"),
               "in its UTF-16 or UTF-32 text"),
    "JSON escape": ("extra.json", lambda path, secret: path.write_text(json.dumps({"t": secret}).replace("_", "\\u005f")),
                    "in its text, once its escapes are decoded"),
    "fake safetensors": ("extra.safetensors", lambda path, secret: path.write_text(secret),
                         "is not a safetensors file"),
}  # fmt: skip


@pytest.mark.parametrize("form", list(ENCODED_FORMS))
def test_a_secret_in_an_encoded_form_is_found_without_showing_it(form, tmp_path):
    name, write, where = ENCODED_FORMS[form]
    secret = fake_secrets()["a Hugging Face token (hf_...)"]
    write(tmp_path / name, secret)
    assert secret.encode() not in (tmp_path / name).read_bytes() or form == "fake safetensors"
    reason = find_secret(tmp_path / name)
    assert reason is not None and where in reason and secret not in reason


@pytest.mark.parametrize(
    "path, where",
    [("transformer/diffusion_pytorch_model.safetensors", "in its header"), ("transformer/config.json", "on line 1")],
)
def test_a_secret_in_a_file_loading_reads_stops_the_upload_without_showing_it(
    saved, hub_calls, tmp_path, capsys, caplog, path, where
):
    secret = fake_secrets()["a Hugging Face token (hf_...)"]
    if path.endswith(".safetensors"):  # in the weights' metadata
        state_dict = safetensors.torch.load_file(saved / path)
        safetensors.torch.save_file(state_dict, saved / path, metadata={"format": "pt", "args": f"--token {secret}"})
    else:  # in a config, whose unexpected values diffusers would print
        (saved / path).write_text(json.dumps({**json.loads((saved / path).read_text()), "hub_token": secret}))

    with pytest.raises(SystemExit) as exit_info:
        main(["push", str(saved), "alice/tiny-lmlp", "--dry-run", "--output-dir", str(tmp_path / "upload")])
    message = str(exit_info.value.code)
    assert message.startswith(
        f"error: The pipeline cannot be published: {path}: holds a Hugging Face token (hf_...) {where}: remove it"
    )
    assert not (tmp_path / "upload").exists()  # the failed dry run leaves no folder behind
    with pytest.raises(ValueError, match="The pipeline cannot be published") as error:
        push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    assert secret not in message + str(error.value) + capsys.readouterr().err + caplog.text and hub_calls == []


def test_the_finished_staging_folder_is_scanned_once_more(tmp_path):
    (tmp_path / "README.md").write_text(f"trained with {fake_secrets()['a GitHub token (ghp_...)']}\n")
    with pytest.raises(ValueError, match=r"staged upload README.md: holds a GitHub token \(ghp_...\) on line 1"):
        check_final_form(tmp_path)


def sample_grid_of(pipe: LMLPPipeline, prompts: list[str], steps: int) -> np.ndarray:
    """The pixels of the grid `stage_pipeline(..., sample_prompts=prompts, sample_steps=steps)` makes."""
    pipe.set_progress_bar_config(disable=True)
    images = pipe(prompts, num_inference_steps=steps, generator=torch.Generator().manual_seed(0)).images
    return np.asarray(make_image_grid(images, captions=prompts))


def test_what_is_checked_described_and_uploaded_is_the_staged_copy(saved, make_pipe, hub_calls, tmp_path, monkeypatch):
    prompts = ["a red circle"]
    before = sample_grid_of(LMLPPipeline.from_pretrained(saved), prompts, 2)
    copy_tree = hub_model.copy_tree

    def copy_after_a_change(source, *args, **kwargs):
        # The source's weights change after the source was loaded and checked, before it is copied.
        make_pipe(seed=1).transformer.save_pretrained(saved / "transformer")
        return copy_tree(source, *args, **kwargs)

    monkeypatch.setattr(hub_model, "copy_tree", copy_after_a_change)
    staged = stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload", sample_prompts=prompts, sample_steps=2)
    uploaded = sample_grid_of(LMLPPipeline.from_pretrained(staged.folder), prompts, 2)
    assert not np.array_equal(uploaded, before)  # the change shows in the images
    # The sample grid (and the card) show the weights that are uploaded, not those loaded before the copy.
    assert np.array_equal(np.asarray(Image.open(staged.folder / "samples.png").convert("RGB")), uploaded)

    # After staging, the source no longer matters: a change to it then is not uploaded.
    monkeypatch.setattr(hub_model, "copy_tree", copy_tree)
    (saved / "notes.txt").write_text("notes\n")
    create_repo = HfApi.create_repo

    def change_the_source(self, *args, **kwargs):
        (saved / "notes.txt").write_text("notes, changed after staging\n")
        return create_repo(self, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_repo", change_the_source)
    push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    assert hub_calls[-1][1]["files"]["notes.txt"] == b"notes\n"


def test_a_file_written_to_while_it_is_copied_is_not_uploaded(saved, tmp_path, monkeypatch):
    notes = saved / "notes.txt"
    notes.write_bytes(b"first half|second half")
    os.utime(notes, ns=(10**18, 10**18))  # an old modification time: the write below surely changes it
    copyfileobj = shutil.copyfileobj

    def torn_copy(source, target, *args):
        if str(getattr(target, "name", "")).endswith("notes.txt"):  # half copied, then the file changes
            target.write(source.read(11))
            notes.write_bytes(b"FIRST HALF|SECOND HALF")
        copyfileobj(source, target, *args)

    monkeypatch.setattr(shutil, "copyfileobj", torn_copy)
    (tmp_path / "upload").mkdir()  # an empty --output-dir given by the user
    with pytest.raises(OSError, match=r"notes.txt changed while it was copied for upload; stage again"):
        stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload")
    assert list((tmp_path / "upload").iterdir()) == []  # nothing of the torn copy is left to upload


def test_new_card_has_the_hub_metadata_and_loads_from_the_repo_id(saved, tmp_path):
    (saved / "training_summary.json").write_text(json.dumps({"steps": 120, "num_processes": 2}))
    stage_pipeline(
        saved, "alice/tiny-lmlp", tmp_path / "upload", base_model="bob/lmlp-base", datasets=["bob/captions"]
    )
    card = card_of(tmp_path / "upload")
    assert (card.data.library_name, card.data.pipeline_tag, card.data.license) == (
        "diffusers", "text-to-image", "apache-2.0"
    )  # fmt: skip
    assert card.data.tags == ["text-to-image", "diffusers", "diffusers-lmlp", "mlp", "l-mlp"]
    assert card.data.base_model == "bob/lmlp-base" and card.data.datasets == ["bob/captions"]
    num_params = sum(p.numel() for p in LMLPPipeline.from_pretrained(saved).transformer.parameters())
    assert f"; {num_params:,} parameters)" in card.text
    assert "- Training: 120 steps on 2 process(es)" in card.text
    assert "- Fine-tuned from [bob/lmlp-base](https://huggingface.co/bob/lmlp-base)" in card.text
    code = usage_code(card)
    assert code.index("import diffusers_lmlp") < code.index('LMLPPipeline.from_pretrained("alice/tiny-lmlp")')


def test_card_update_keeps_what_the_user_wrote(saved, tmp_path):
    begin, end = block_markers("usage")
    (saved / "README.md").write_text(
        "---\nlicense: mit\nlanguage: en\ntags:\n- shapes\n---\n\n# My model\n\nNotes the user wrote.\n\n"
        f"{begin}\nold usage for alice/old-name\n{end}\n\n## Limitations\n\nMore user text.\n"
    )
    stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload", sample_prompts=["a red circle"], sample_steps=2)
    card = card_of(tmp_path / "upload")
    assert card.data.license == "mit" and card.data.language == "en"
    assert card.data.tags == ["shapes", "text-to-image", "diffusers", "diffusers-lmlp", "mlp", "l-mlp"]
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-image"
    assert card.text.startswith("\n# My model\n\nNotes the user wrote.\n\n" + begin)
    assert card.text.endswith(f"{end}\n\n## Limitations\n\nMore user text.\n")
    assert "alice/old-name" not in card.text and card.text.count(begin) == 1
    assert 'LMLPPipeline.from_pretrained("alice/tiny-lmlp")' in card.text
    assert "![samples](samples.png)" in card.text and (tmp_path / "upload" / "samples.png").is_file()

    # Staging the staged folder again changes nothing: the update is idempotent.
    stage_pipeline(tmp_path / "upload", "alice/tiny-lmlp", tmp_path / "again")
    assert card_of(tmp_path / "again").content == card.content


@pytest.mark.slow
def test_training_script_push_uploads_the_run_without_its_state(pipe, hub_calls, tmp_path):
    # The output folder as the training script's finish() leaves it (a local base: no base_model), then its push.
    output_dir = tmp_path / "lmlp-model"
    pipe.save_pretrained(output_dir)
    make_image_grid([Image.new("RGB", (16, 16))], captions=["a red circle"]).save(output_dir / "samples.png")
    (output_dir / "validation").mkdir()
    (output_dir / "validation" / "step-0000010.png").write_bytes((output_dir / "samples.png").read_bytes())
    summary = {"num_processes": 1, "steps": 10}
    (output_dir / "training_summary.json").write_text(json.dumps(summary))
    args = dict(pretrained_model_name_or_path=str(tmp_path / "base"), learning_rate=1e-3, train_batch_size=64,
                use_ema=True, ema_decay=0.995, caption_dropout=0.1, hub_model_id=None,
                hub_token=HUB_TOKEN)  # fmt: skip
    write_model_card(output_dir, pipe, args=args, summary=summary, sample_grid=output_dir / "samples.png")
    for path, data in TRAINING_LEFTOVERS.items():
        (output_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / path).write_bytes(data)

    push_pipeline(output_dir, output_dir.name, token=HUB_TOKEN, commit_message="End of training")
    files = hub_calls[-1][1]["files"]
    assert set(files) == PIPELINE_FILES | {"samples.png", "training_summary.json", "validation/step-0000010.png"}
    assert not [path for path, data in files.items() if HUB_TOKEN.encode() in data]  # the token is in no file
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model is None and card.data.library_name == "diffusers"
    assert "- Training: 10 steps on the procedural shapes world, batch 64" in card.text
    assert card.text.count("## Use") == 1 and card.text.count("![samples](samples.png)") == 1
    assert 'from_pretrained("alice/lmlp-model")' in card.text and 'from_pretrained("lmlp-model")' not in card.text


def usage_code(card: ModelCard) -> str:
    return card.text.split("```python\n")[1].split("```")[0]


def test_card_lists_the_closed_vocabulary_and_its_snippet_samples_a_caption_as_the_scores_were(
    pipe, tmp_path, monkeypatch, caplog
):
    folder = tmp_path / "tiny-lmlp"
    pipe.save_pretrained(folder)
    sampler = {"scheduler": "DPMSolverMultistepScheduler", "num_inference_steps": 3, "guidance_scale": 1.5}
    sampler.update(batch_size=100, dtype="float32", resolution=16)
    summary = {"steps": 10, "evaluation_sampler": sampler, "sample_prompts": ["a small red circle", "a blue square"]}
    card = write_model_card(folder, pipe, summary=summary)

    words = sorted(word for word in TINY_VOCAB_WORDS if len(word) > 1)
    assert (
        f"- Vocabulary: closed, {len(words)} words: {', '.join(words)}, and any single letter or digit. " in card.text
    )
    assert (
        "- Scores measured (`diffusers_lmlp.evaluation`) with the sampler settings "
        "`scheduler=DPMSolverMultistepScheduler`, `num_inference_steps=3`, `guidance_scale=1.5`, `batch_size=100`, "
        "`dtype=float32`, `resolution=16`\n"
    ) in card.text
    code = usage_code(card)
    assert 'image = pipe("a small red circle", num_inference_steps=3, guidance_scale=1.5).images[0]' in code
    assert "These are the settings the scores were measured with." in card.text

    # The snippet runs as a user pastes it (the repo id is the folder's name here), and its caption is all known words.
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(code, namespace)
    assert namespace["image"].size == (16, 16)
    assert "outside the tokenizer's vocabulary" not in caplog.text


def test_card_of_an_open_vocabulary_lists_no_words_and_its_snippet_has_a_generic_prompt(pipe, tmp_path):
    tokenizer = subword_tokenizer(tmp_path / "tokenizer")
    open_pipe = LMLPPipeline(
        **{**pipe.components, "tokenizer": tokenizer, "text_encoder": tiny_clip_text_encoder(tokenizer)}
    )
    folder = tmp_path / "open"
    open_pipe.save_pretrained(folder)
    card = write_model_card(folder, open_pipe)
    assert "Vocabulary" not in card.text and "Scores measured" not in card.text
    assert f"image = pipe({json.dumps(GENERIC_PROMPT)}).images[0]" in usage_code(card)
    assert "These are the settings" not in card.text


def test_committed_shapes_pipeline_stages_with_its_card(tmp_path):
    staged = stage_pipeline(PIPELINE_PATH, "alice/lmlp-shapes", tmp_path / "upload")
    assert {"README.md", "samples.png", "training_summary.json", "transformer/config.json"} <= set(staged.files)
    assert staged.refused == {}  # no file of the shipped pipeline is taken for a secret or a credential
    card = card_of(staged.folder)
    assert card.data.library_name == "diffusers" and "l-mlp" in card.data.tags
    assert "Shapes scorer on held-out captions" in card.text  # the existing description is kept


def test_a_pipeline_whose_scheduler_would_draw_wrong_images_is_not_published(pipe, hub_calls, tmp_path):
    """DDIM's own `clip_sample=True`: refused by the dry run and the push, with the fix, before anything is sent."""
    from diffusers import DDIMScheduler

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=True)
    pipe.save_pretrained(tmp_path / "ddim")
    with pytest.raises(ValueError, match=r"DDIMScheduler has clip_sample=True.*Pass clip_sample=False"):
        stage_pipeline(tmp_path / "ddim", "alice/x", output_dir=tmp_path / "staged")
    assert not (tmp_path / "staged").exists()
    with pytest.raises(SystemExit, match="error: DDIMScheduler has clip_sample=True"):
        main(["push", str(tmp_path / "ddim"), "alice/tiny-lmlp", "--token", "hf_test"])
    assert hub_calls == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repo_id": "alice/bad name"}, "model repo id 'alice/bad name' is not a valid Hub repo id"),
        ({"base_model": "a/b/c"}, "base model 'a/b/c' is not a valid Hub repo id"),
        ({"output_dir": "NOT_EMPTY"}, "already exists and is not an empty folder"),
        ({"output_dir": "INSIDE"}, "is inside .*tiny-lmlp, which it copies"),
        ({"remove": "model_index.json"}, "is not a saved pipeline: it has no model_index.json"),
        ({"remove": "transformer/diffusion_pytorch_model.safetensors"}, "holds only pickled weights"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(saved, tmp_path, kwargs, message):
    if "remove" in kwargs:
        (saved / kwargs["remove"]).unlink()
    outputs = {"NOT_EMPTY": tmp_path, "INSIDE": saved / "upload"}
    kwargs = {key: outputs.get(value, value) for key, value in kwargs.items() if key != "remove"}
    with pytest.raises((ValueError, FileExistsError), match=message):
        stage_pipeline(saved, **{"repo_id": "alice/x", **kwargs})
    assert not (saved / "upload").exists() and list(tmp_path.iterdir()) == [saved]


def test_push_creates_the_repo_then_makes_one_commit(saved, hub_calls, generate, tmp_path, monkeypatch):
    commit = push_pipeline(saved, "tiny-lmlp", token="hf_test", private=True, commit_message="End of training")
    assert [name for name, _ in hub_calls] == ["whoami", "create_repo", "create_commit"]
    create_repo, create_commit = hub_calls[1][1], hub_calls[2][1]
    assert create_repo == {"repo_id": "alice/tiny-lmlp", "private": True, "exist_ok": True}
    assert create_commit["repo_id"] == "alice/tiny-lmlp" and create_commit["commit_message"] == "End of training"
    assert set(create_commit["files"]) == PIPELINE_FILES
    assert commit.commit_url == "https://huggingface.co/alice/tiny-lmlp/commit/abc"

    # What the commit would upload loads back from the Hub cache by repo id and generates the same image.
    uploaded = tmp_path / "commit"
    for path, data in create_commit["files"].items():
        (uploaded / path).parent.mkdir(parents=True, exist_ok=True)
        (uploaded / path).write_bytes(data)
    assert 'from_pretrained("alice/tiny-lmlp")' in card_of(uploaded).text
    fill_hub_cache(uploaded, tmp_path / "cache", "alice/tiny-lmlp")
    monkeypatch.setattr(HfApi, "model_info", MODEL_INFO)  # the real one: offline, the download reads the cache
    from_hub = LMLPPipeline.from_pretrained("alice/tiny-lmlp", cache_dir=tmp_path / "cache")
    assert torch.equal(generate(from_hub), generate(LMLPPipeline.from_pretrained(saved)))


def test_push_without_a_token_says_how_to_get_one(saved, hub_calls, monkeypatch):
    monkeypatch.setattr("diffusers_lmlp.hub.upload.get_token", lambda: None)
    with pytest.raises(ValueError, match="No Hugging Face token: pass --token"):
        push_pipeline(saved, "alice/tiny-lmlp")
    assert hub_calls == []


@pytest.fixture
def space_dir(tmp_path) -> Path:
    """A demo folder like `spaces/lmlp-demo/`, with local run leftovers."""
    folder = tmp_path / "spaces"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"x")
    (folder / ".gradio").mkdir()
    (folder / ".gradio" / "cache.json").write_text("{}")
    (folder / "app.py").write_text('import os\nMODEL = os.environ.get("LMLP_MODEL")\n')
    (folder / "requirements.txt").write_text("diffusers\n")
    (folder / "README.md").write_text(
        "---\ntitle: L-MLP demo\nsdk: gradio\nsdk_version: 6.31.0\napp_file: app.py\nmodels:\n- someone/else\n---\n\n"
        "# Demo\n"
    )
    return folder


def demo_files(staged) -> list[str]:
    """The staged Space's files but the vendored package."""
    return [path for path in staged.files if not path.startswith("diffusers_lmlp/")]


def test_space_upload_is_the_demo_and_this_package_s_source_sets_the_model_variable_and_makes_one_commit(
    space_dir, hub_calls, tmp_path
):
    # An old copy of the package in the demo folder stays out: the Space gets this install's source, and only that.
    (space_dir / "diffusers_lmlp" / "models").mkdir(parents=True)
    (space_dir / "diffusers_lmlp" / "__init__.py").write_text("OLD = True\n")
    (space_dir / "diffusers_lmlp" / "models" / "backbone.py").write_text("")
    staged = stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload")
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"] and staged.refused == {}
    assert list(staged.left_out) == [".gradio/", "__pycache__/", "diffusers_lmlp/"]
    package = Path(diffusers_lmlp.__file__).parent
    source = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "lmlp_demo" not in p.parts}
    assert {path.removeprefix("diffusers_lmlp/") for path in staged.files} - set(demo_files(staged)) == source
    assert (staged.folder / "diffusers_lmlp" / "__init__.py").read_bytes() == (package / "__init__.py").read_bytes()
    assert not [path for path in staged.files if "assets/" in path or path.endswith((".safetensors", ".png"))]
    card = SpaceCard.load(staged.folder / "README.md")
    assert card.data.models == ["alice/tiny-lmlp"] and card.data.sdk == "gradio" and card.data.title == "L-MLP demo"
    assert card.text == "\n# Demo\n"

    push_space("alice/lmlp-demo", "alice/tiny-lmlp", space_dir, token="hf_test")
    assert [name for name, _ in hub_calls] == ["model_info", "create_repo", "add_space_variable", "create_commit"]
    model_info, create_repo, variable, commit = (arguments for _, arguments in hub_calls)
    assert model_info == {"repo_id": "alice/tiny-lmlp"}
    assert create_repo == {"repo_id": "alice/lmlp-demo", "repo_type": "space", "space_sdk": "gradio", "private": None,
                           "exist_ok": True}  # fmt: skip
    assert variable == {"repo_id": "alice/lmlp-demo", "key": "LMLP_MODEL", "value": "alice/tiny-lmlp"}
    assert commit["repo_id"] == "alice/lmlp-demo" and commit["repo_type"] == "space"
    assert {path: (staged.folder / path).read_bytes() for path in staged.files} == commit["files"]


def test_package_demo_stages_its_three_files_and_the_package_source(tmp_path):
    staged = stage_space("alice/lmlp-shapes", output_dir=tmp_path / "space")
    demo = sorted(p.relative_to(DEFAULT_SPACE_DIR).as_posix() for p in DEFAULT_SPACE_DIR.rglob("*") if p.is_file())
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"]
    assert demo_files(staged) == [p for p in demo if "__pycache__" not in p]
    assert staged.refused == {}  # no file of the demo is taken for a credential or a secret
    for name in ("app.py", "requirements.txt"):
        assert (staged.folder / name).read_bytes() == (DEFAULT_SPACE_DIR / name).read_bytes()
    # In a checkout, the demo is the repository's Space folder; it stays far below the Space's size limits.
    assert DEFAULT_SPACE_DIR == Path(__file__).resolve().parents[2] / "spaces" / "lmlp-demo"
    sizes = [(staged.folder / name).stat().st_size for name in staged.files]
    assert max(sizes) < SPACE_FILE_LIMIT[0] / 100 and sum(sizes) < 1_000_000  # docs/hub.md: under 1 MB
    card = SpaceCard.load(staged.folder / "README.md")
    assert card.data.models == ["alice/lmlp-shapes"] and card.data.sdk == "gradio"
    # The card tells the Space's owner that the Space runs its own copy of the package, no model repo's code.
    assert "vendored" in card.text and "trust_remote_code" not in card.text


def test_space_upload_refuses_links_and_credentials(space_dir, hub_calls, tmp_path, caplog):
    (tmp_path / "secret.txt").write_bytes(OUTSIDE_SECRET)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "cat.png").write_bytes(OUTSIDE_SECRET)
    (space_dir / "notes.txt").symlink_to(tmp_path / "secret.txt")
    (space_dir / "examples").symlink_to(tmp_path / "examples", target_is_directory=True)
    (space_dir / "hf_token.txt").write_text("hf_abc")
    (space_dir / "server.pem").write_text("-----BEGIN PRIVATE KEY-----")
    refused = {
        "examples/": f"a symbolic link to a folder, {tmp_path / 'examples'}; links are never followed",
        "hf_token.txt": "the name looks like a credential",
        "notes.txt": f"a symbolic link to {tmp_path / 'secret.txt'}; links are never followed",
        "server.pem": "the name looks like a credential",
    }

    staged = stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload")  # what the dry run writes
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"]
    assert not any(p.startswith("examples/") for p in staged.files)
    assert staged.refused == refused

    push_space("alice/lmlp-demo", "alice/tiny-lmlp", space_dir, token=HUB_TOKEN)
    files = hub_calls[-1][1]["files"]
    assert set(files) == set(staged.files)
    assert not [path for path, data in files.items() if OUTSIDE_SECRET in data or b"hf_abc" in data]
    assert not [path for path, data in files.items() if HUB_TOKEN.encode() in data]
    assert "Refused, never uploaded:\n" + "".join(f"  {p}: {r}\n" for p, r in refused.items()) in caplog.text

    (space_dir / "app.py").rename(tmp_path / "app.py")
    (space_dir / "app.py").symlink_to(tmp_path / "app.py")
    with pytest.raises(
        ValueError, match=r"app.py cannot be uploaded: a symbolic link to .*; links are never followed"
    ):
        stage_space("alice/tiny-lmlp", space_dir)


def sparse_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.slow
def test_space_over_its_size_limits_is_refused_naming_the_file_and_the_limit(space_dir, hub_calls, tmp_path):
    sparse_file(space_dir / "weights.bin", SPACE_FILE_LIMIT[0] + 1)
    staged = stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload")
    assert staged.refused == {
        "weights.bin": "10,000,001 bytes, over the limit of 10,000,000 bytes for a file of a Space (weights and data "
        "belong in model or dataset repos)"
    }
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"]

    (space_dir / "weights.bin").unlink()
    for number in range(6):  # each below the file limit, 54 MB together
        sparse_file(space_dir / "examples" / f"{number}.bin", 9_000_000)
    message = (
        r"spaces holds more than 50,000,000 bytes to upload, the limit for a Space \(weights and data belong in model "
        r"or dataset repos\) \(the limit was passed at examples/5.bin, 9,000,000 bytes\)"
    )
    with pytest.raises(ValueError, match=message):
        stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload-2")
    assert not (tmp_path / "upload-2").exists()  # what was copied before the limit is gone
    with pytest.raises(ValueError, match=message):
        push_space("alice/lmlp-demo", "alice/tiny-lmlp", space_dir, token=HUB_TOKEN)
    assert hub_calls == []


def test_space_refuses_a_missing_model_repo_and_no_app(space_dir, hub_calls, monkeypatch):
    with pytest.raises(ValueError, match="needs its owner: write 'owner/tiny-lmlp'"):
        push_space("alice/lmlp-demo", "tiny-lmlp", space_dir, token="hf_test")

    def not_found(self, repo_id, **kwargs):
        raise RepositoryNotFoundError("404 Repository Not Found", response=SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(HfApi, "model_info", not_found)
    with pytest.raises(ValueError, match="The model repo alice/missing does not exist, or this token cannot see it"):
        push_space("alice/lmlp-demo", "alice/missing", space_dir, token="hf_test")

    (space_dir / "app.py").unlink()
    with pytest.raises(FileNotFoundError, match="is not a Gradio Space folder \\(no app.py\\)"):
        stage_space("alice/tiny-lmlp", space_dir)
    assert hub_calls == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["push", "MISSING", "alice/x", "--dry-run"], "error: MISSING is not a folder"),
        (["push", "SAVED", "alice/x y", "--dry-run"], "error: model repo id 'alice/x y' is not a valid Hub repo id"),
        (["push", "SAVED", "alice/x", "--output-dir", "o"], "--output-dir only goes with --dry-run"),
        (
            ["push-space", "lmlp-demo", "--model", "alice/x", "--dry-run"],
            "error: Space id 'lmlp-demo' needs its owner",
        ),
        (["push-space", "alice/lmlp-demo", "--dry-run"], "the following arguments are required: --model"),
    ],
)
def test_cli_bad_arguments_give_clear_messages(saved, argv, message, capsys):
    argv = [str(saved) if a == "SAVED" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    output = capsys.readouterr().err + str(exit_info.value.code)
    assert message in output


def test_cli_push_space_help_says_the_space_gets_the_package_source(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["push-space", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Upload the Gradio demo, spaces/lmlp-demo/ (app.py, README.md, requirements.txt; it ships in" in text
    assert "and this install's package source beside it (diffusers-lmlp is not on PyPI)" in text
    assert "a repo pushed with or without --with-code serves, and none of its code runs." in text


@pytest.mark.parametrize("backbone", sorted(FAMILIES))
def test_card_names_every_family_by_its_registry_label_and_tag(backbone, tmp_path):
    family = FAMILIES[backbone]
    pipe = build_tiny_pipeline(backbone, seed=0)
    card = write_model_card(tmp_path, pipe)
    assert family.tag in card.data.tags
    assert f"**{family.label}** backbone ({family.paper}; " in card.text
    assert f"Backbone: `{family.model_class.__name__}`" in card.text
    others = [other for other in FAMILIES.values() if other.label != family.label]
    assert not [other.label for other in others if f"**{other.label}**" in card.text or other.tag in card.data.tags]


@pytest.mark.parametrize(
    "argv0, usage",
    [
        ("/home/me/.venv/bin/diffusers-lmlp-hub", "usage: diffusers-lmlp-hub "),  # the console script
        ("/opt/venv/Scripts/diffusers-lmlp-hub.exe", "usage: diffusers-lmlp-hub "),  # Windows names it .exe
        ("/home/me/.venv/lib/python3.11/site-packages/diffusers_lmlp/hub/__main__.py", "usage: python -m diffusers_lmlp.hub "),
    ],
)  # fmt: skip
def test_usage_names_the_command_as_the_user_ran_it(argv0, usage, monkeypatch):
    assert program_name(argv0) == usage.split(": ")[1].strip()
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    assert build_parser().format_usage().startswith(usage)
