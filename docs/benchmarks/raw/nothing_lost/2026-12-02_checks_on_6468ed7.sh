#!/bin/bash
# Behaviours of 6468ed7 that tests/test_nothing_lost.py and friends now forbid, checked through the CLI.
cd /tmp/old; source /work/main/.venv/bin/activate; export PYTHONPATH=/tmp/old
FAST="data.train_batch_size=8 data.max_response_length=12 data.synthetic_train_size=200 data.synthetic_val_size=16 actor.ppo_mini_batch_size=4 critic.ppo_mini_batch_size=4 actor.ppo_micro_batch_size_per_device=4 critic.ppo_micro_batch_size_per_device=4 actor.log_prob_micro_batch_size_per_device=8 critic.log_prob_micro_batch_size_per_device=8 rollout.n=2 model.tiny_hidden_size=64 trainer.sft_warmup_steps=5 trainer.logger=[jsonl] trainer.test_freq=-1"
R=/tmp/oldcheck/run; rm -rf $R /tmp/oldcheck/out*
python -m jaxppo.train trainer.default_local_dir=$R $FAST trainer.total_training_steps=4 trainer.save_freq=1 trainer.max_to_keep=4 > /dev/null 2>&1; echo "base run rc=$?"
# 1 export into a non-empty dir
mkdir -p /tmp/oldcheck/out1; echo keep > /tmp/oldcheck/out1/precious.txt
python -m jaxppo.export --ckpt $R/checkpoints/4 --out /tmp/oldcheck/out1 > /dev/null 2>&1; echo "1 export rc=$? precious kept: $(ls /tmp/oldcheck/out1 | grep -c precious)"
# 2 corrupt newest checkpoint
cp -r $R /tmp/oldcheck/run2; rm /tmp/oldcheck/run2/checkpoints/4/actor/_METADATA
python -m jaxppo.train trainer.default_local_dir=/tmp/oldcheck/run2 $FAST trainer.total_training_steps=5 > /tmp/oldcheck/o2.txt 2>&1; echo "2 corrupt newest: rc=$? traceback lines: $(grep -c Traceback /tmp/oldcheck/o2.txt)"
# 3 config.yaml rewritten by a failed start with another tiny shape
cp -r $R /tmp/oldcheck/run3; md5a=$(md5sum < /tmp/oldcheck/run3/config.yaml)
python -m jaxppo.train trainer.default_local_dir=/tmp/oldcheck/run3 $FAST trainer.total_training_steps=6 model.tiny_hidden_size=128 > /tmp/oldcheck/o3.txt 2>&1; echo "3 other tiny shape: rc=$? config.yaml changed: $([ "$md5a" != "$(md5sum < /tmp/oldcheck/run3/config.yaml)" ] && echo yes || echo no)"
# 4 duplicated metrics lines after a resume past logged-but-not-checkpointed steps
cp -r $R /tmp/oldcheck/run4; rm -rf /tmp/oldcheck/run4/checkpoints/4 /tmp/oldcheck/run4/checkpoints/3
python -m jaxppo.train trainer.default_local_dir=/tmp/oldcheck/run4 $FAST trainer.total_training_steps=4 trainer.save_freq=1 trainer.max_to_keep=4 > /dev/null 2>&1; echo "4 resume: step 3 lines: $(grep -c '"step": 3,' /tmp/oldcheck/run4/metrics.jsonl)"
# 5 a reward that calls sys.exit(0)
printf 'import sys\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    sys.exit(0)\n' > /tmp/oldcheck/exit.py
python -m jaxppo.train trainer.default_local_dir=/tmp/oldcheck/run5 $FAST trainer.total_training_steps=2 custom_reward_function.path=/tmp/oldcheck/exit.py > /tmp/oldcheck/o5.txt 2>&1; echo "5 sys.exit reward: rc=$? done line: $(grep -c '^done' /tmp/oldcheck/o5.txt) checkpoints: $(ls /tmp/oldcheck/run5/checkpoints 2>/dev/null | wc -l)"
# 7 NaN / out-of-range floats accepted
python -c "
from jaxppo.config import load_config
for o in ['actor.clip_ratio_low=-5', 'algorithm.gamma=nan', 'critic.cliprange_value=nan']:
    try: load_config(None, [o]); print('7', o, 'accepted')
    except Exception as e: print('7', o, 'refused', e)
"
# 8 fewer rows than the batch; YAML syntax error
python -m jaxppo.train trainer.default_local_dir=/tmp/oldcheck/run8 $FAST data.synthetic_train_size=4 > /tmp/oldcheck/o8.txt 2>&1; echo "8 few rows: rc=$? traceback: $(grep -c Traceback /tmp/oldcheck/o8.txt)"
printf 'data:\n  train_batch_size: [1,\n' > /tmp/oldcheck/bad.yaml
python -m jaxppo.train --config /tmp/oldcheck/bad.yaml trainer.default_local_dir=/tmp/oldcheck/run9 > /tmp/oldcheck/o9.txt 2>&1; echo "8 yaml: rc=$? traceback: $(grep -c Traceback /tmp/oldcheck/o9.txt)"
