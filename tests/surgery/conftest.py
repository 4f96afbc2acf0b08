from tests.models.conftest import _kernel_path, _one_cpu_thread, interpreted

__all__ = ["_kernel_path", "_one_cpu_thread", "interpreted"]
