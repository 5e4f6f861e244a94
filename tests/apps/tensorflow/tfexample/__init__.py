"""tfexample: a Flower / TensorFlow app."""
