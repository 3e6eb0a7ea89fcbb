"""The paper's kappa study in small: baselines and Free Transformers at several kappa on real text, over
seeds, with honest likelihoods (`free-transformer study`)."""
