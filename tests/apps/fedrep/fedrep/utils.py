"""fedrep: the model manager the run config's model-name picks."""
from fedrep.implemented_models.cnn_cifar10 import CNNCifar10ModelManager


def get_model_manager_class(context):
    model_name = str(context.run_config["model-name"]).lower()
    if model_name == "cnncifar10":
        return CNNCifar10ModelManager
    raise NotImplementedError(f"Model {model_name} not implemented, check name.")
