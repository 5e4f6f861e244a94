"""tfexample: the Keras model (imports keras; rankaudit never runs it)."""
import keras
from keras import layers


def load_model(learning_rate: float = 0.001):
    model = keras.Sequential(
        [
            keras.Input(shape=(32, 32, 3)),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.Flatten(),
            layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy")
    return model
