"""The public API (`fedjax_pfedes/__init__.py`): a researcher's own Flax module and arrays run
under pFedES without editing package files; every public name is documented."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

import fedjax_pfedes
from fedjax_pfedes.models import architectures, backbones


class TinyNet(nn.Module):
    """A user's backbone: flattened input → 24 features."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(24, name="user_dense")(x.reshape((x.shape[0], -1))))


def _digits_with_writers(n_writers: int = 6):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    test, train = order[:300], order[300:]
    writers = rng.integers(0, n_writers, len(train))
    return x[train], y[train], x[test], y[test], writers


def _config(name: str, arch: str):
    config = fedjax_pfedes.default_config()
    config.data.name = name
    config.data.partition = "natural"
    config.data.num_clients = 6
    config.clients.architectures = f"{arch},mlp"
    config.proxy_arch = "proxy_mlp"
    config.proxy_dim = 16
    config.train.rounds = 2
    config.eval.every = 1
    config.checkpoint.every = 0
    return config


@pytest.mark.slow
def test_pfedes_runs_on_a_users_flax_module_and_arrays(tmp_path):
    x_train, y_train, x_test, y_test, writers = _digits_with_writers()
    fedjax_pfedes.register_architecture("tiny_user_net", TinyNet(), modalities=("image",))
    fedjax_pfedes.register_dataset("user_digits", lambda options: fedjax_pfedes.from_arrays(
        "user_digits", x_train, y_train, x_test, y_test, client_ids=writers, options=options))
    summary = fedjax_pfedes.run(_config("user_digits", "tiny_user_net"), str(tmp_path),
                                progress=False)
    # one client per writer (the natural partition of the given client ids), half on the
    # user's module
    assert summary["clients_per_arch"] == {"tiny_user_net": 3, "mlp": 3}
    final = summary["final"]
    assert 0.0 <= final["personalized_accuracy_by_arch"]["tiny_user_net"] <= 1.0
    assert final["round"] == 2
    # the registered module is the client's backbone F_k, under pFedES's own heads
    model = architectures.client_model("tiny_user_net", 10, 16, fedjax_pfedes.from_arrays(
        "d", x_train, y_train, x_test, y_test).input_spec)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    assert set(params) == {"backbone", "projection", "classifier"}
    assert params["backbone"]["user_dense"]["kernel"].shape == (64, 24)


def test_from_arrays_checks_the_users_arrays_naming_the_array():
    x = np.zeros((10, 4), np.float32)
    y = np.array([0, 1] * 5)
    with pytest.raises(fedjax_pfedes.DataError, match=r"x_train has 10 rows but y_train has 9"):
        fedjax_pfedes.from_arrays("mine", x, y[:9], x, y)
    x_bad = x.copy()
    x_bad[3, 1] = np.nan
    with pytest.raises(fedjax_pfedes.DataError, match=r"x_train\[3\] holds a non-finite value"):
        fedjax_pfedes.from_arrays("mine", x_bad, y, x, y)
    data = fedjax_pfedes.from_arrays("mine", x, y, x, y, client_ids=np.arange(10) % 3)
    assert (data.modality, data.num_classes, len(np.unique(data.groups_train))) == (
        "tabular", 2, 3)


def test_registering_over_a_built_in_name_or_a_non_module_is_refused():
    with pytest.raises(ValueError, match="'convnet3' is a built-in architecture"):
        fedjax_pfedes.register_architecture("convnet3", TinyNet())
    with pytest.raises(ValueError, match="module must be a flax.linen.Module"):
        fedjax_pfedes.register_architecture("other_net", 3)
    with pytest.raises(ValueError, match="modalities must be a non-empty subset"):
        fedjax_pfedes.register_architecture("other_net", TinyNet(), modalities=("audio",))
    with pytest.raises(ValueError, match="'mnist5k' is a built-in dataset"):
        fedjax_pfedes.register_dataset("mnist5k", lambda options: None)
    assert "other_net" not in backbones.BACKBONES


@pytest.mark.slow
def test_an_unregistered_name_is_a_config_error_naming_the_field(tmp_path):
    config = _config("mnist5k", "not_registered_net")
    with pytest.raises(fedjax_pfedes.ConfigError, match="config.clients.architectures"):
        fedjax_pfedes.run(config, str(tmp_path), progress=False)


def test_every_public_name_is_documented():
    for name in fedjax_pfedes.__all__:
        obj = getattr(fedjax_pfedes, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, f"fedjax_pfedes.{name} has no docstring"
        if inspect.isfunction(obj) and name != "default_config":
            assert "Args:" in doc, f"fedjax_pfedes.{name} lacks an Args: block"
        if inspect.isfunction(obj) and inspect.signature(obj).return_annotation not in (
                None, "None", inspect.Signature.empty):
            assert "Returns:" in doc, f"fedjax_pfedes.{name} lacks a Returns: block"


@pytest.mark.slow
def test_the_readme_python_example_runs_as_written(tmp_path, capsys):
    """The README's "Use it from Python" block, executed (2 rounds, in a scratch workdir)."""
    import pathlib

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("```python\n") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    run_line = 'summary = fedjax_pfedes.run(config, "runs/mine", callbacks=[StopAt()])'
    assert run_line in code
    code = code.replace(run_line, "config.train.rounds = 2\n"
                        f"summary = fedjax_pfedes.run(config, {str(tmp_path)!r}, "
                        "progress=False, callbacks=[StopAt()])")
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "'mynet':" in printed and "'mlp':" in printed, printed
