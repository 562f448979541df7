"""Publishing to the Hub, offline: the staged upload, its guards, its card, the huggingface_hub calls, the CLI."""

import inspect
import json
import os
import re
import shutil
from functools import partialmethod
from pathlib import Path
from types import SimpleNamespace

import documents
import numpy as np
import pytest
import safetensors.torch
import torch
from diffusers import DDIMScheduler
from huggingface_hub import CommitInfo, HfApi, ModelCard, ModelInfo, RepoUrl, SpaceCard
from huggingface_hub.errors import RepositoryNotFoundError
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from test_vocabulary import subword_tokenizer

import diffusers_lmlp
from diffusers_lmlp import FAMILIES, LMLPPipeline, unknown_words
from diffusers_lmlp.hub import push_pipeline, push_space, stage_pipeline, stage_space, write_model_card
from diffusers_lmlp.hub import space as hub_space
from diffusers_lmlp.hub import upload as hub_upload
from diffusers_lmlp.hub.__main__ import main
from diffusers_lmlp.hub.card import GENERIC_PROMPT, POOLED_TEXT_PROJECTION, block_markers
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR, SPACE_FILE_LIMIT, SPACE_TOTAL_LIMIT
from diffusers_lmlp.hub.upload import TEXT_LIMIT, check_final_form, find_secret, looks_like_credential
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.tiny import TINY_VOCAB_WORDS, build_tiny_pipeline, tiny_clip_text_encoder, tiny_clip_tokenizer


PIPELINE_FILES = set("""
README.md model_index.json scheduler/scheduler_config.json text_encoder/config.json text_encoder/model.safetensors
tokenizer/tokenizer.json tokenizer/tokenizer_config.json transformer/config.json vae/config.json
transformer/diffusion_pytorch_model.safetensors vae/diffusion_pytorch_model.safetensors
""".split())  # fmt: skip
HUB_TOKEN = "hf_TestTokenThatMustNeverBeUploaded"
OUTSIDE_SECRET = b"OUTSIDE-THE-FOLDER: must never be uploaded\n"
LINK = "links are never followed"
# What a training run leaves next to the pipeline, none of which belongs on the Hub.
TRAINING_LEFTOVERS = dict.fromkeys("""
checkpoint-100/model.safetensors checkpoint-100/optimizer.bin .checkpoint-200.tmp/model.safetensors logs/run.json
logs/lmlp-text-to-image/events.out.tfevents.1.host transformer/diffusion_pytorch_model.bin optimizer.pt ema.pth
model.ckpt state.pkl scratch.tmp/notes.json __pycache__/x.json
""".split(), b"x")  # fmt: skip


def write_files(folder: Path, files: dict[str, bytes | str]) -> None:
    for path, data in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def saved(pipe, tmp_path) -> Path:
    """The tiny pipeline saved with `save_pretrained`, plus training leftovers that must not be uploaded."""
    pipe.save_pretrained(tmp_path / "tiny-lmlp")
    write_files(tmp_path / "tiny-lmlp", TRAINING_LEFTOVERS)
    return tmp_path / "tiny-lmlp"


@pytest.fixture
def hub_calls(monkeypatch):
    """HfApi's network calls as (method, arguments by name); `create_commit`'s also hold each uploaded file's bytes."""
    calls, url = [], "https://huggingface.co/{repo_id}"
    results = {
        "whoami": lambda kwargs: {"name": "alice"},
        "create_repo": lambda kwargs: RepoUrl(url.format(**kwargs)),
        "add_space_variable": lambda kwargs: {},
        "model_info": lambda kwargs: ModelInfo(id=kwargs["repo_id"], private=False),
        "create_commit": lambda kwargs: CommitInfo(  # keywords: older huggingface_hub takes no positionals
            commit_url=url.format(**kwargs) + "/commit/abc", commit_message="", commit_description="", oid="abc"
        ),
    }
    signatures = {name: inspect.signature(getattr(HfApi, name)) for name in results}

    def record(self, name, *args, **kwargs):
        bound = {k: v for k, v in signatures[name].bind(self, *args, **kwargs).arguments.items() if k != "self"}
        if name == "create_commit":
            bound["files"] = {o.path_in_repo: Path(o.path_or_fileobj).read_bytes() for o in bound["operations"]}
        calls.append((name, bound))
        return results[name](bound)

    for name in results:
        monkeypatch.setattr(HfApi, name, partialmethod(record, name))
    return calls


def usage_code(card: ModelCard) -> str:
    return card.text.split("```python\n")[1].split("```")[0]


def test_upload_leaves_out_training_state_and_this_machine_s_paths(saved, tmp_path):
    # As diffusers' own save leaves them: each config names where it was loaded from (a Hub repo id stays).
    written = {
        "model_index.json": "stabilityai/a-base",
        "vae/config.json": "/home/alice/models/sd-vae-ft-mse",
        "transformer/config.json": str(tmp_path / "run" / "transformer"),
        "scheduler/scheduler_config.json": "/home/alice/.cache/huggingface/hub/models--a--b/snapshots/0/scheduler",
        "tokenizer/tokenizer_config.json": "/home/alice/models/clip",  # transformers < 4.27: "name_or_path"
    }
    for name, value in written.items():
        key = "name_or_path" if "tokenizer" in name else "_name_or_path"
        (saved / name).write_text(json.dumps({**json.loads((saved / name).read_text()), key: value}, indent=2))
    before = {name: (saved / name).read_text() for name in written}

    staged = stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload")
    assert set(staged.files) == PIPELINE_FILES and staged.refused == {}
    left_out = ".checkpoint-200.tmp/ __pycache__/ checkpoint-100/ ema.pth logs/ model.ckpt optimizer.pt scratch.tmp/"
    assert list(staged.left_out) == [*left_out.split(), "state.pkl", "transformer/diffusion_pytorch_model.bin"]
    assert staged.left_out["checkpoint-100/"].startswith("matches 'checkpoint-*': training state")
    assert staged.left_out["optimizer.pt"].startswith("pickled (only safetensors weights are uploaded")
    for name in written:  # the rest of each config goes up as it was
        config = json.loads(before[name])
        expected = {k: v for k, v in config.items() if not (k.endswith("name_or_path") and v.startswith("/"))}
        assert json.loads((staged.folder / name).read_text()) == expected, name
    assert {name: (saved / name).read_text() for name in written} == before  # the source is untouched
    assert (saved / "optimizer.pt").is_file() and not (saved / "README.md").exists()


def fake_secrets() -> dict[str, str]:
    """A made-up secret of every kind, by its name in the report (assembled, so no scanner takes this file for one)."""
    w = "AbCd1234"
    return {
        "a Hugging Face token (hf_...)": "hf_" + w * 5,
        "a Hugging Face organization token (api_org_...)": "api_org_" + w * 4,
        "an AWS access key id (AKIA...)": "AKIA" + "ABCD2345" * 2, "a GitHub token (ghp_...)": "ghp_" + w * 5,
        "a GitHub token (github_pat_...)": "github_pat_" + "11ABCDEFG0_" + w * 6,
        "an OpenAI API key (sk-...)": "sk-proj-" + w * 3 + "T3Blbk" + "FJ" + w * 3,
        "an Anthropic API key (sk-ant-...)": "sk-ant-api03-" + w * 6,
        "a Google API key (AIza...)": "AIza" + w * 4 + "xyz",
        "a Slack token (xox...)": "xoxb-" + "123456789012-" + w * 3,
        "a private key (-----BEGIN ... PRIVATE KEY-----)": "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3Bl\n",
    }  # fmt: skip


HF_SECRET = fake_secrets()["a Hugging Face token (hf_...)"]
REVOKE = "remove it from the file (and revoke it); the secret is not shown here"
AWS_KEY = fake_secrets()["an AWS access key id (AKIA...)"]


def png_with_text(path: Path, text: str, chunk: str) -> None:
    """A PNG whose text chunk `chunk` ("zTXt" or "iTXt", both compressed) holds `text`."""
    info = PngInfo()
    info.add_itxt("Comment", text, zip=True) if chunk == "iTXt" else info.add_text("Comment", text, zip=True)
    Image.new("RGB", (4, 4)).save(path, pnginfo=info)
    assert chunk.encode() in path.read_bytes() and text.encode() not in path.read_bytes()


@pytest.mark.slow
def test_links_outside_files_credentials_secrets_and_oversize_files_are_refused_by_the_dry_run_and_the_push(
    saved, hub_calls, generate, tmp_path, capsys, caplog, monkeypatch
):
    assert TEXT_LIMIT[0] > 3_642_074  # far above CLIP's tokenizer.json; a small limit here keeps the test cheap
    monkeypatch.setattr(hub_upload, "TEXT_LIMIT", (50_000, TEXT_LIMIT[1]))
    # Links, credential-like names, secrets in files and names, a FIFO, an oversize json: refused; tokenizer files not.
    outside = tmp_path / "outside"
    write_files(outside, {"secret.txt": OUTSIDE_SECRET, "outside.json": OUTSIDE_SECRET, "folder/config.json": "{}"})
    os.link(outside / "outside.json", saved / "notes.json")  # a second name for a file outside the folder
    (saved / "a.json").write_text("{}")
    os.link(saved / "a.json", saved / "b.json")  # two names inside the folder: a link all the same
    links = {"extra": outside / "folder", "passwd.txt": "/etc/passwd", "tokenizer/copy.json": "tokenizer.json",
             "tokenizer/vocab.txt": outside / "secret.txt", "up.json": "../outside/secret.txt"}  # fmt: skip
    for path, target in links.items():  # inside the folder or out, each is refused
        (saved / path).symlink_to(target)
    os.mkfifo(saved / "pipe.json")  # copying a FIFO would block or fail
    special_tokens = json.dumps(LMLPPipeline.from_pretrained(saved).tokenizer.special_tokens_map)
    write_files(saved, {
        "token.txt": "hf_abc", "secrets.json": '{"api_key": "abc"}', ".env": "HF_TOKEN=hf_abc",
        "credentials/hub.json": '{"token": "hf_abc"}', "big.json": b" " * (hub_upload.TEXT_LIMIT[0] + 1),
        "limit.json": b" " * hub_upload.TEXT_LIMIT[0],  # exactly at the limit: uploaded
        "notes.txt": f"run notes\nHF_TOKEN={HF_SECRET}\n", f"notes-{HF_SECRET}.txt": "harmless",
        "run/settings.json": json.dumps({"aws_key": AWS_KEY}, indent=1),
        # Tokenizer files a credential rule must not catch.
        "tokenizer/special_tokens_map.json": special_tokens, "tokenizer/added_tokens.json": "{}",
    })  # fmt: skip
    png_with_text(saved / "samples.png", f"trained with --hub_token {HF_SECRET}", "zTXt")
    hard_link = "a hard link (2 names for one file, maybe outside the folder): copy it to a file of its own"
    refused = dict(sorted({
        **dict.fromkeys(["a.json", "b.json", "notes.json"], hard_link),
        **dict.fromkeys(["credentials/", "secrets.json", "token.txt"], "the name looks like a credential"),
        **{path: f"a symbolic link to {target}; {LINK}" for path, target in links.items() if path != "extra"},
        "extra/": f"a symbolic link to a folder, {outside / 'folder'}; {LINK}",
        "big.json": "50,001 bytes, over the limit of 50,000 bytes for .json, .txt and .md files",
        "pipe.json": "not a regular file (a FIFO, socket or device)",
        "run/settings.json": f"holds an AWS access key id (AKIA...) on line 2: {REVOKE}",
        "notes-<secret>.txt": "its name holds a secret (not shown here): rename it",
        "notes.txt": f"holds a Hugging Face token (hf_...) on line 2: {REVOKE}",
        "samples.png": f"holds a Hugging Face token (hf_...) in its image text chunks: {REVOKE}",
    }.items()))  # fmt: skip
    expected = PIPELINE_FILES | {"limit.json", "tokenizer/special_tokens_map.json", "tokenizer/added_tokens.json"}
    report = "Refused, never uploaded:\n" + "".join(f"  {path}: {reason}\n" for path, reason in refused.items())
    main(["push", str(saved), "alice/tiny-lmlp", "--dry-run", "--output-dir", str(tmp_path / "upload")])
    dry_run = capsys.readouterr()
    staged = list((tmp_path / "upload").rglob("*"))
    assert {p.relative_to(tmp_path / "upload").as_posix() for p in staged if p.is_file()} == expected
    assert not [p for p in staged if p.is_symlink()]
    assert report in dry_run.out and "Left out, not part of the upload:\n" in dry_run.out
    assert "  .env: a hidden file\n" in dry_run.out
    main(["push", str(saved), "alice/tiny-lmlp", "--token", HUB_TOKEN])
    files = hub_calls[-1][1]["files"]
    assert set(files) == expected
    assert not [p for p, data in files.items() if OUTSIDE_SECRET in data or b"root:" in data or b"hf_abc" in data]
    assert report in caplog.text and "  .env: a hidden file\n" in caplog.text  # the push logs it, as a warning
    assert [r.levelname for r in caplog.records if r.name == "diffusers_lmlp.hub.upload"] == ["WARNING"]
    shown = dry_run.out + dry_run.err + capsys.readouterr().out + caplog.text + str(list(files.values()))
    assert HF_SECRET not in shown and AWS_KEY not in shown and HF_SECRET[3:20] not in shown
    uploaded = generate(LMLPPipeline.from_pretrained(tmp_path / "upload"))
    assert torch.equal(uploaded, generate(LMLPPipeline.from_pretrained(saved)))


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


LOOKALIKES = [
    "-----BEGIN PUBLIC KEY-----", "-----BEGIN CERTIFICATE-----", "hf_hub_download", "HF_TOKEN=", "sk-" + "a" * 60,
    "AKIA" + "ABCD2345" * 3, "ghp_short", "api_org_", "the token is set in the Space's settings",
]  # fmt: skip


@pytest.mark.parametrize(("kind", "text"), [*fake_secrets().items(), *((None, text) for text in LOOKALIKES)])
def test_each_kind_of_secret_is_found_and_named_without_showing_it_and_lookalikes_are_not(kind, text, tmp_path):
    write_files(tmp_path, {"notes.txt": f"notes\nthe key: {text}\n", "word.txt": f"x{text}", "short.txt": text[:12]})
    assert find_secret(tmp_path / "notes.txt") == (kind and f"holds {kind} on line 2: {REVOKE}")
    # Glued to a longer word, or cut short, it is no secret of that format.
    assert find_secret(tmp_path / "word.txt") is None or "PRIVATE KEY" in kind
    assert find_secret(tmp_path / "short.txt") is None


ENCODED_FORMS = {
    "zTXt": ("samples.png", lambda path: png_with_text(path, HF_SECRET, "zTXt"), "in its image text chunks"),
    "iTXt": ("samples.png", lambda path: png_with_text(path, HF_SECRET, "iTXt"), "in its image text chunks"),
    "UTF-16": ("notes.txt", lambda path: path.write_text(f"HF_TOKEN={HF_SECRET}\n", encoding="utf-16"),
               "in its UTF-16 or UTF-32 text"),
    "JSON escape": ("extra.json", lambda path: path.write_text(json.dumps({"t": HF_SECRET}).replace("_", "\\u005f")),
                    "in its text, once its escapes are decoded"),
    "fake safetensors": ("extra.safetensors", lambda path: path.write_text(HF_SECRET), "is not a safetensors file"),
}  # fmt: skip


@pytest.mark.parametrize("form", list(ENCODED_FORMS))
def test_a_secret_in_an_encoded_form_is_found_without_showing_it(form, tmp_path):
    name, write, where = ENCODED_FORMS[form]
    write(tmp_path / name)
    assert HF_SECRET.encode() not in (tmp_path / name).read_bytes() or form == "fake safetensors"
    reason = find_secret(tmp_path / name) or ""
    assert where in reason and HF_SECRET not in reason


@pytest.mark.slow
def test_a_tokenizer_vocabulary_of_the_docs_words_is_not_taken_for_secrets(tmp_path):
    # Saved both ways CLIP tokenizers are saved. Shipped files: staged with `refused == {}` by the tests below.
    words = tuple(sorted(set(re.findall(r"[a-z]{2,}", documents.texts().lower()))))
    assert len(words) > 1000
    tiny_clip_tokenizer(77, tmp_path, words=words).save_pretrained(tmp_path)
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in tmp_path.iterdir()}
    assert not {path.name: reason for path in tmp_path.iterdir() if (reason := find_secret(path))}


@pytest.mark.parametrize(
    "path, message",
    [
        ("transformer/diffusion_pytorch_model.safetensors",
         r"published: transformer/diffusion_pytorch_model.safetensors: holds a Hugging Face token \(hf_...\) in its"),
        ("transformer/config.json",
         r"published: transformer/config.json: holds a Hugging Face token \(hf_...\) on line 1"),
        ("tokenizer/tokenizer.json", r"\(tokenizer/tokenizer.json: a symbolic link to .*\), the uploaded pipeline "
         r"would not work: .* neither tokenizer.json nor vocab.json.*Replace links with the files themselves"),
    ],
)  # fmt: skip
def test_a_refused_file_the_pipeline_needs_stops_the_upload_without_showing_a_secret(
    saved, hub_calls, tmp_path, capsys, caplog, path, message
):
    if path.endswith(".safetensors"):  # in the weights' metadata
        safetensors.torch.save_file(safetensors.torch.load_file(saved / path), saved / path, {"args": HF_SECRET})
    elif path.endswith("config.json"):  # diffusers would print the config's unexpected values
        (saved / path).write_text(json.dumps({**json.loads((saved / path).read_text()), "hub_token": HF_SECRET}))
    else:
        (saved / path).rename(tmp_path / "tokenizer.json")
        (saved / path).symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(SystemExit, match=message) as exit_info:
        main(["push", str(saved), "alice/tiny-lmlp", "--dry-run", "--output-dir", str(tmp_path / "upload")])
    assert not (tmp_path / "upload").exists()  # the failed dry run leaves no folder behind
    with pytest.raises(ValueError, match=message) as error:
        push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    shown = str(exit_info.value.code) + str(error.value) + capsys.readouterr().err + caplog.text
    assert HF_SECRET not in shown and hub_calls == []  # nothing was created or committed


def test_the_finished_staging_folder_is_scanned_once_more(tmp_path):
    (tmp_path / "README.md").write_text(f"trained with {fake_secrets()['a GitHub token (ghp_...)']}\n")
    with pytest.raises(ValueError, match=r"staged upload README.md: holds a GitHub token \(ghp_...\) on line 1"):
        check_final_form(tmp_path)


def sample_grid_of(folder: Path) -> np.ndarray:
    """The pixels of the grid `stage_pipeline(..., sample_prompts=["a red circle"], sample_steps=2)` makes."""
    pipe = LMLPPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(["a red circle"], num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    return np.asarray(make_image_grid(images, captions=["a red circle"]))


def test_what_is_checked_described_and_uploaded_is_the_staged_copy(saved, make_pipe, hub_calls, tmp_path, monkeypatch):
    before, copy_tree = sample_grid_of(saved), hub_upload.copy_tree

    def copy_after_a_change(source, *args, **kwargs):
        # The source's weights change after the source was loaded and checked, before it is copied.
        make_pipe(seed=1).transformer.save_pretrained(saved / "transformer")
        return copy_tree(source, *args, **kwargs)

    monkeypatch.setattr(hub_upload, "copy_tree", copy_after_a_change)
    staged = stage_pipeline(saved, "alice/x", tmp_path / "upload", sample_prompts=["a red circle"], sample_steps=2)
    uploaded = sample_grid_of(staged.folder)
    assert not np.array_equal(uploaded, before)  # the change shows in the images
    # The sample grid (and the card) show the weights that are uploaded, not those loaded before the copy.
    assert np.array_equal(np.asarray(Image.open(staged.folder / "samples.png").convert("RGB")), uploaded)
    # After staging, the source no longer matters: a change to it then is not uploaded.
    monkeypatch.setattr(hub_upload, "copy_tree", copy_tree)
    (saved / "notes.txt").write_text("notes\n")
    create_repo = HfApi.create_repo  # the recorder

    def change_the_source(self, *args, **kwargs):
        (saved / "notes.txt").write_text("notes, changed after staging\n")
        return create_repo(self, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_repo", change_the_source)
    push_pipeline(saved, "alice/tiny-lmlp", token=HUB_TOKEN)
    assert hub_calls[-1][1]["files"]["notes.txt"] == b"notes\n"


def test_a_file_written_to_while_it_is_copied_is_not_uploaded(saved, tmp_path, monkeypatch):
    notes, copyfileobj = saved / "notes.txt", shutil.copyfileobj
    notes.write_bytes(b"first half|second half")
    os.utime(notes, ns=(10**18, 10**18))  # an old modification time: the write below surely changes it

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


def test_new_card_has_the_hub_metadata_and_an_updated_one_keeps_what_the_user_wrote(saved, tmp_path):
    (saved / "training_summary.json").write_text(json.dumps({"steps": 120, "num_processes": 2}))
    stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "up", base_model="bob/lmlp-base", datasets=["bob/captions"])
    data = (card := ModelCard.load(tmp_path / "up" / "README.md")).data
    assert (data.library_name, data.pipeline_tag, data.license) == ("diffusers", "text-to-image", "apache-2.0")
    assert data.tags == ["text-to-image", "diffusers", "diffusers-lmlp", "mlp", "l-mlp"]
    assert data.base_model == "bob/lmlp-base" and data.datasets == ["bob/captions"]
    num_params = sum(p.numel() for p in LMLPPipeline.from_pretrained(saved).transformer.parameters())
    assert f"; {num_params:,} parameters)" in card.text and "- Training: 120 steps on 2 process(es)" in card.text
    assert "- Fine-tuned from [bob/lmlp-base](https://huggingface.co/bob/lmlp-base)" in card.text
    code = usage_code(card)
    assert code.index("import diffusers_lmlp") < code.index('LMLPPipeline.from_pretrained("alice/tiny-lmlp")')
    # An update keeps what the user wrote.
    begin, end = block_markers("usage")
    (saved / "README.md").write_text(
        "---\nlicense: mit\nlanguage: en\ntags:\n- shapes\n---\n\n# My model\n\nNotes the user wrote.\n\n"
        f"{begin}\nold usage for alice/old-name\n{end}\n\n## Limitations\n\nMore user text.\n"
    )
    stage_pipeline(saved, "alice/tiny-lmlp", tmp_path / "upload", sample_prompts=["a red circle"], sample_steps=2)
    card = ModelCard.load(tmp_path / "upload" / "README.md")
    assert card.data.license == "mit" and card.data.language == "en"
    assert card.data.tags == ["shapes", "text-to-image", "diffusers", "diffusers-lmlp", "mlp", "l-mlp"]
    assert (card.data.library_name, card.data.pipeline_tag) == (data.library_name, data.pipeline_tag)
    assert card.text.startswith("\n# My model\n\nNotes the user wrote.\n\n" + begin)
    assert card.text.endswith(f"{end}\n\n## Limitations\n\nMore user text.\n")
    assert "alice/old-name" not in card.text and card.text.count(begin) == 1
    assert 'LMLPPipeline.from_pretrained("alice/tiny-lmlp")' in card.text
    assert "![samples](samples.png)" in card.text and (tmp_path / "upload" / "samples.png").is_file()
    stage_pipeline(tmp_path / "upload", "alice/tiny-lmlp", tmp_path / "again")
    assert ModelCard.load(tmp_path / "again" / "README.md").content == card.content


def test_card_lists_a_closed_vocabulary_and_its_snippet_uses_the_scores_sampler(pipe, tmp_path, monkeypatch, caplog):
    pipe.save_pretrained(tmp_path / "tiny-lmlp")
    sampler = {"scheduler": "DPMSolverMultistepScheduler", "num_inference_steps": 3, "guidance_scale": 1.5,
               "batch_size": 100, "dtype": "float32", "resolution": 16}  # fmt: skip
    summary = {"steps": 10, "evaluation_sampler": sampler, "sample_prompts": ["a small red circle", "a blue square"]}
    card = write_model_card(tmp_path / "tiny-lmlp", pipe, summary=summary)
    words = sorted(word for word in TINY_VOCAB_WORDS if len(word) > 1)
    assert f"- Vocabulary: closed, {len(words)} words: {', '.join(words)}, and any single letter or " in card.text
    listed = ", ".join(f"`{name}={value}`" for name, value in sampler.items())
    assert f"- Scores measured (`diffusers_lmlp.evaluation`) with the sampler settings {listed}\n" in card.text
    code = usage_code(card)
    assert 'image = pipe("a small red circle", num_inference_steps=3, guidance_scale=1.5).images[0]' in code
    assert "These are the settings the scores were measured with." in card.text
    # The snippet runs as a user pastes it (the repo id is the folder's name here), and its caption is all known words.
    monkeypatch.chdir(tmp_path)
    exec(code, namespace := {})
    assert namespace["image"].size == (16, 16) and "outside the tokenizer's vocabulary" not in caplog.text
    # An open vocabulary, and no scores: no word list, no settings, a generic prompt.
    tokenizer = subword_tokenizer(tmp_path / "tokenizer")
    open_pipe = LMLPPipeline(**{**pipe.components, "tokenizer": tokenizer,
                                "text_encoder": tiny_clip_text_encoder(tokenizer)})  # fmt: skip
    card = write_model_card(tmp_path / "tiny-lmlp", open_pipe)
    assert not [text for text in ("Vocabulary", "Scores measured", "These are the settings") if text in card.text]
    assert f"image = pipe({json.dumps(GENERIC_PROMPT)}).images[0]" in usage_code(card)


@pytest.fixture(scope="module")
def shapes_pipe():
    return pretrained_shapes_pipeline()


@pytest.mark.parametrize("how", ["write_model_card", "hub push"])
def test_a_closed_vocabulary_card_without_sample_captions_samples_words_the_model_knows(shapes_pipe, how, tmp_path):
    assert unknown_words(shapes_pipe.tokenizer, GENERIC_PROMPT)  # the generic prompt would be noise to this model
    shapes_pipe.save_pretrained(tmp_path / "shapes")
    if how == "write_model_card":
        text = write_model_card(tmp_path / "shapes", shapes_pipe).text
    else:  # a save_pretrained folder without a card or training summary, staged for a push
        staged = stage_pipeline(tmp_path / "shapes", "someone/shapes", tmp_path / "staged")
        text = (staged.folder / "README.md").read_text(encoding="utf-8")
    prompt = re.search(r'image = pipe\("([^"]*)"', text).group(1)
    assert prompt != GENERIC_PROMPT and unknown_words(shapes_pipe.tokenizer, prompt) == []
    # The shapes preset has the caption projection (the papers' layout, as the tiny pipelines, has not).
    assert shapes_pipe.transformer.config.pooled_text_projection
    assert next(line for line in text.splitlines() if line.startswith("- Backbone:")).endswith(POOLED_TEXT_PROJECTION)


@pytest.mark.parametrize("backbone", sorted(FAMILIES))
def test_card_names_every_family_by_its_registry_label_and_tag(backbone, tmp_path):
    family = FAMILIES[backbone]
    card = write_model_card(tmp_path, build_tiny_pipeline(backbone, seed=0))
    assert family.tag in card.data.tags and "pooled_text_projection" not in card.text
    assert f"**{family.label}** backbone ({family.paper}; " in card.text
    assert f"Backbone: `{family.model_class.__name__}`" in card.text
    others = [other for other in FAMILIES.values() if other.label != family.label]
    assert not [other.label for other in others if f"**{other.label}**" in card.text or other.tag in card.data.tags]


def test_committed_shapes_pipeline_stages_with_its_card(tmp_path):
    staged = stage_pipeline(PIPELINE_PATH, "alice/lmlp-shapes", tmp_path / "upload")
    assert {"README.md", "samples.png", "training_summary.json", "transformer/config.json"} <= set(staged.files)
    assert staged.refused == {}  # no file of the shipped pipeline is taken for a secret or a credential
    card = ModelCard.load(staged.folder / "README.md")
    assert card.data.library_name == "diffusers" and "l-mlp" in card.data.tags
    assert "Shapes scorer on held-out captions" in card.text  # the existing description is kept


def test_training_script_push_creates_the_repo_then_makes_one_commit(saved, pipe, hub_calls, tmp_path, monkeypatch):
    monkeypatch.setattr("diffusers_lmlp.hub.upload.get_token", lambda: None)
    with pytest.raises(ValueError, match="No Hugging Face token: pass --token"):
        push_pipeline(saved, "alice/tiny-lmlp")
    assert hub_calls == []
    # The output folder as the training script's finish() leaves it (a local base: no base_model), then its push.
    make_image_grid([Image.new("RGB", (16, 16))], captions=["a red circle"]).save(saved / "samples.png")
    summary = {"num_processes": 1, "steps": 10}
    write_files(saved, {"validation/step-10.png": (saved / "samples.png").read_bytes(),
                        "training_summary.json": json.dumps(summary)})  # fmt: skip
    args = dict(pretrained_model_name_or_path=str(tmp_path / "base"), learning_rate=1e-3, train_batch_size=64,
                hub_model_id=None, hub_token=HUB_TOKEN)  # fmt: skip
    write_model_card(saved, pipe, args=args, summary=summary, sample_grid=saved / "samples.png")
    commit = push_pipeline(saved, "tiny-lmlp", token=HUB_TOKEN, private=True, commit_message="End of training")
    assert [name for name, _ in hub_calls] == ["whoami", "create_repo", "create_commit"]
    (_, create_repo), (_, create_commit) = hub_calls[1:]
    assert create_repo == {"repo_id": "alice/tiny-lmlp", "private": True, "exist_ok": True}
    assert create_commit["repo_id"] == "alice/tiny-lmlp" and create_commit["commit_message"] == "End of training"
    files = create_commit["files"]
    assert set(files) == PIPELINE_FILES | {"samples.png", "training_summary.json", "validation/step-10.png"}
    assert commit.commit_url == "https://huggingface.co/alice/tiny-lmlp/commit/abc"
    assert not [path for path, data in files.items() if HUB_TOKEN.encode() in data]  # the token is in no file
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model is None and card.data.library_name == "diffusers"
    assert "- Training: 10 steps on the procedural shapes world, batch 64" in card.text
    assert card.text.count("## Use") == 1 and card.text.count("![samples](samples.png)") == 1
    assert 'from_pretrained("alice/tiny-lmlp")' in card.text and 'from_pretrained("tiny-lmlp")' not in card.text


@pytest.fixture
def space_dir(tmp_path) -> Path:
    """A demo folder like `spaces/lmlp-demo/`, with local run leftovers."""
    write_files(tmp_path / "spaces", {
        "__pycache__/app.cpython-311.pyc": b"x", ".gradio/cache.json": "{}", "requirements.txt": "diffusers\n",
        "app.py": 'import os\nMODEL = os.environ.get("LMLP_MODEL")\n',
        "README.md": "---\ntitle: L-MLP demo\nsdk: gradio\nsdk_version: 6.31.0\napp_file: app.py\nmodels:\n"
        "- someone/else\n---\n\n# Demo\n",
    })  # fmt: skip
    return tmp_path / "spaces"


def demo_files(staged) -> list[str]:
    """The staged Space's files but the vendored package."""
    return [path for path in staged.files if not path.startswith("diffusers_lmlp/")]


def test_space_upload_is_the_demo_and_package_source_not_links_or_credentials(space_dir, hub_calls, tmp_path, caplog):
    # An old copy of the package in the demo folder stays out: the Space gets this install's source, and only that.
    write_files(space_dir, {"diffusers_lmlp/__init__.py": "OLD = True\n", "diffusers_lmlp/models/backbone.py": "",
                            "hf_token.txt": "hf_abc", "server.pem": "-----BEGIN PRIVATE KEY-----"})  # fmt: skip
    write_files(tmp_path, {"secret.txt": OUTSIDE_SECRET, "examples/cat.png": OUTSIDE_SECRET})
    (space_dir / "notes.txt").symlink_to(tmp_path / "secret.txt")
    (space_dir / "examples").symlink_to(tmp_path / "examples")
    refused = {
        "examples/": f"a symbolic link to a folder, {tmp_path / 'examples'}; {LINK}",
        "hf_token.txt": "the name looks like a credential",
        "notes.txt": f"a symbolic link to {tmp_path / 'secret.txt'}; {LINK}",
        "server.pem": "the name looks like a credential",
    }
    staged = stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload")  # what the dry run writes
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"] and staged.refused == refused
    assert list(staged.left_out) == [".gradio/", "__pycache__/", "diffusers_lmlp/"]
    package = Path(diffusers_lmlp.__file__).parent
    source = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "lmlp_demo" not in p.parts}
    assert {path.removeprefix("diffusers_lmlp/") for path in staged.files} - set(demo_files(staged)) == source
    assert (staged.folder / "diffusers_lmlp" / "__init__.py").read_bytes() == (package / "__init__.py").read_bytes()
    card = SpaceCard.load(staged.folder / "README.md")
    assert card.data.models == ["alice/tiny-lmlp"] and card.data.sdk == "gradio" and card.data.title == "L-MLP demo"
    assert card.text == "\n# Demo\n"

    push_space("alice/lmlp-demo", "alice/tiny-lmlp", space_dir, token=HUB_TOKEN)
    assert [name for name, _ in hub_calls] == ["model_info", "create_repo", "add_space_variable", "create_commit"]
    model_info, create_repo, variable, commit = (arguments for _, arguments in hub_calls)
    assert model_info == {"repo_id": "alice/tiny-lmlp"}
    assert create_repo == {"repo_id": "alice/lmlp-demo", "repo_type": "space", "space_sdk": "gradio", "private": None,
                           "exist_ok": True}  # fmt: skip
    assert variable == {"repo_id": "alice/lmlp-demo", "key": "LMLP_MODEL", "value": "alice/tiny-lmlp"}
    assert commit["repo_id"] == "alice/lmlp-demo" and commit["repo_type"] == "space"
    assert {path: (staged.folder / path).read_bytes() for path in staged.files} == commit["files"]
    assert not any(OUTSIDE_SECRET in data or re.search(b"hf_(abc|Test)", data) for data in commit["files"].values())
    assert "Refused, never uploaded:\n" + "".join(f"  {p}: {r}\n" for p, r in refused.items()) in caplog.text

    (space_dir / "app.py").rename(tmp_path / "app.py")
    (space_dir / "app.py").symlink_to(tmp_path / "app.py")
    with pytest.raises(ValueError, match=rf"app.py cannot be uploaded: a symbolic link to .*; {LINK}"):
        stage_space("alice/tiny-lmlp", space_dir)


def test_package_demo_stages_its_three_files_and_the_package_source(tmp_path):
    staged = stage_space("alice/lmlp-shapes", output_dir=tmp_path / "space")
    demo = sorted(p.relative_to(DEFAULT_SPACE_DIR).as_posix() for p in DEFAULT_SPACE_DIR.rglob("[!_]*") if p.is_file())
    assert demo_files(staged) == ["README.md", "app.py", "requirements.txt"] == demo
    assert staged.refused == {}  # no file of the demo is taken for a credential or a secret
    assert not [path for path in staged.files if "assets/" in path or path.endswith((".safetensors", ".png"))]
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


def test_space_refuses_bad_model_repos_no_app_and_oversize_files(space_dir, hub_calls, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs its owner: write 'owner/tiny-lmlp'"):
        push_space("alice/lmlp-demo", "tiny-lmlp", space_dir, token="hf_test")
    error = RepositoryNotFoundError("404 Repository Not Found", response=SimpleNamespace(headers={}, request=None))
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kwargs: (_ for _ in ()).throw(error))
    with pytest.raises(ValueError, match="The model repo alice/missing does not exist, or this token cannot see it"):
        push_space("alice/lmlp-demo", "alice/missing", space_dir, token="hf_test")
    # The demo and the package source are far below the real limits: scaled down here, so that little is copied.
    monkeypatch.setattr(hub_space, "SPACE_FILE_LIMIT", (100_000, SPACE_FILE_LIMIT[1]))
    monkeypatch.setattr(hub_space, "SPACE_TOTAL_LIMIT", (500_000, SPACE_TOTAL_LIMIT[1]))
    write_files(space_dir, {"weights.bin": b"\0" * 100_001})
    staged = stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload")
    assert staged.refused == {"weights.bin": "100,001 bytes, over the limit of 100,000 bytes for a file of a Space "
                              "(weights and data belong in model or dataset repos)"}  # fmt: skip
    (space_dir / "weights.bin").unlink()
    write_files(space_dir, {f"examples/{number}.bin": b"\0" * 90_000 for number in range(6)})  # 540 kB together
    message = r"spaces holds more than 500,000 bytes to upload, .* \(the limit was passed at examples/5.bin, 90,000 b"
    with pytest.raises(ValueError, match=message):
        stage_space("alice/tiny-lmlp", space_dir, tmp_path / "upload-2")
    assert not (tmp_path / "upload-2").exists()  # what was copied before the limit is gone
    with pytest.raises(ValueError, match=message):
        push_space("alice/lmlp-demo", "alice/tiny-lmlp", space_dir, token=HUB_TOKEN)
    (space_dir / "app.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"is not a Gradio Space folder \(no app.py\)"):
        stage_space("alice/tiny-lmlp", space_dir)
    assert hub_calls == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["push", "MISSING", "alice/x"], "error: MISSING is not a folder"),
        (["push", "SAVED", "alice/x y"], "error: model repo id 'alice/x y' is not a valid Hub repo id"),
        (["push", "SAVED", "alice/x", "--base-model", "a/b/c"], "base model 'a/b/c' is not a valid Hub repo id"),
        (["push", "SAVED", "alice/x", "--output-dir", "o"], "--output-dir only goes with --dry-run"),
        (["push", "SAVED", "alice/x", "--output-dir", "NOT_EMPTY"], "already exists and is not an empty folder"),
        (["push", "SAVED", "alice/x", "--output-dir", "INSIDE"], "is inside .*tiny-lmlp, which it copies"),
        (["push", "SAVED", "alice/x", "REMOVE", "model_index.json"], "is not a saved pipeline: it has no model_index"),
        (["push", "SAVED", "alice/x", "REMOVE", "transformer/diffusion_pytorch_model.safetensors"], "only pickled"),
        (["push-space", "lmlp-demo", "--model", "alice/x"], "error: Space id 'lmlp-demo' needs its owner"),
        (["push-space", "alice/lmlp-demo"], "the following arguments are required: --model"),
        (["push", "SAVED", "alice/x", "DDIM"], "error: DDIMScheduler has clip_sample=True.*Pass clip_sample=False"),
    ],
)  # fmt: skip
def test_bad_cli_input_is_refused_before_anything_is_written(pipe, saved, hub_calls, tmp_path, argv, message, capsys):
    if "REMOVE" in argv:
        (saved / argv[-1]).unlink()
        argv = argv[:-2]
    if "DDIM" in argv:  # a scheduler that would draw wrong images
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=True)
        pipe.save_pretrained(saved)
        argv = argv[:-1]
    where = {"SAVED": str(saved), "NOT_EMPTY": str(tmp_path), "INSIDE": str(saved / "upload")}
    with pytest.raises(SystemExit) as exit_info:
        main([where.get(a, a) for a in argv] + ["--dry-run"] * ("o" not in argv))
    assert exit_info.value.code != 0
    assert re.search(message, capsys.readouterr().err + str(exit_info.value.code))
    assert not (saved / "upload").exists() and list(tmp_path.iterdir()) == [saved] and hub_calls == []
