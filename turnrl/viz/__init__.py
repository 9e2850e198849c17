"""See what an agent did: an HTML report of a run or an evaluation, and training curves."""
