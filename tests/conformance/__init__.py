"""TensorFlow's and Keras' own contracts run through safevars."""
