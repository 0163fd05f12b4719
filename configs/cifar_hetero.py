"""The published pFedES setup: CIFAR-10, 100 clients, CNN-1..CNN-5, 2 classes per client.

Yi et al., AAAI 2025: client k uses CNN-((k mod 5)+1); each client holds 2 classes with per-class
shares ~ U(0.4, 0.6); its local test split has the same classes. CIFAR-10 is read through
tfds.data_source and must be prepared beforehand (`tfds build cifar10 --file_format=array_record`
on a machine with internet); without it the run stops at once with those instructions.

  python -m launch.main --config=configs/cifar_hetero.py --workdir=runs/cifar_hetero \
      --config.data.data_dir=/path/to/tensorflow_datasets
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.data.name = "cifar10"
    config.data.global_test_fraction = 0.1
    config.data.num_clients = 100
    config.data.partition = "pathological"
    config.data.classes_per_client = 2
    config.clients.architectures = "cnn1,cnn2,cnn3,cnn4,cnn5"
    config.train.rounds = 100
    config.train.client_fraction = 0.1
    config.train.batch_size = 64
    config.train.lr_local = 0.01
    config.train.local_momentum = 0.9
    config.eval.every = 10
    config.eval.global_test_samples = 2000
    return config
