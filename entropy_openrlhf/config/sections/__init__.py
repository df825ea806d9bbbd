"""One module per `--section.*` flag group, or per small family of them:

- model_data.py: `--model.*`, `--data.*`
- rollout.py: `--rollout.*`
- actor.py: `--actor.*`
- loss.py: `--loss.*` (and `--loss.<objective>.*`), `--entropy.*`, `--algo.*`
- train.py: `--train.*`, `--async.*`, `--sync.*`
- offpolicy.py: `--offpolicy.*`
- reference.py: `--ref.*`
- reward_eval.py: `--reward.*`, `--eval.*`
- tools.py: `--tools.*`
- logger_ray.py: `--logger.*`, `--ray.*`

`config/schema.py` assembles them into `Config`, in the order of `--help` and of `flatten()`.
"""
