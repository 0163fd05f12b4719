"""The upload pipeline: each stage against numpy / hand references / dp_accounting."""


import fl_helpers
import pytest
from fl_helpers import pipeline_config, upload_pipeline

from configs import tabular_hetero
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import UploadPipeline


def test_incompatible_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="config.upload.weighting='uniform'"):
        upload_pipeline(dp=privacy.ClientDPConfig(clip_norm=1.0))
    with pytest.raises(ValueError, match="config.upload.aggregator must be 'mean'"):
        upload_pipeline(secagg=True, aggregator="median")
    with pytest.raises(ValueError, match="own server math"):
        UploadPipeline(pipeline_config(aggregator="median"), "custom", "fedgh", 10, 4, 4, 5)
    with pytest.raises(ValueError, match="config.dp.accountant='pld' needs"):
        privacy.ClientDPConfig(clip_norm=1.0, accountant="pld", sampling="fixed")


def test_every_registered_algorithm_builds_with_the_aggregation_it_declares():
    from fedjax_pfedes.algorithms import registry
    from fedjax_pfedes.engine.build import build_algorithm, build_federated_data
    from fedjax_pfedes.engine.validate import aggregation_kind

    tabular = tabular_hetero.get_config()
    images = fl_helpers.small_config()
    data = {"tabular": build_federated_data(tabular), "images": build_federated_data(images)}
    assert len(registry.names()) >= 16
    for name, entry in registry.entries().items():
        config, kind = (images, "images") if name == "pfedes_paper" else (tabular, "tabular")
        config.algorithm = name
        algorithm = build_algorithm(config, data[kind])
        assert algorithm.name == name
        assert algorithm.aggregation == entry.aggregation == aggregation_kind(name), name
