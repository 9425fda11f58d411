"""Operating a run from the outside: joining it, watching it, taking its model out."""
