"""pip install --no-build-isolation .  (Debian's setuptools, offline)

Builds the _stepmesh extension with CMake (the same python/CMakeLists.txt as a
normal build; tests, benchmarks, examples and CUDA off) and packages it with
the pure-Python modules of python/stepmesh. docs/python.md: Install.
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPython3_EXECUTABLE={sys.executable}", "-DSTEPMESH_BUILD_TESTS=OFF",
                        "-DSTEPMESH_BUILD_BENCHMARKS=OFF", "-DSTEPMESH_BUILD_EXAMPLES=OFF",
                        "-DSTEPMESH_ENABLE_CUDA=OFF", "-DSTEPMESH_BUILD_PYTHON=ON"], check=True)
        subprocess.run(["cmake", "--build", build_dir, "--target", "_stepmesh", "-j",
                        str(os.cpu_count() or 1)], check=True)
        built = os.path.join(build_dir, "python", "stepmesh", self.get_ext_filename("_stepmesh"))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)


setup(
    name="stepmesh",
    version="0.1.0",
    description="Attention-FFN disaggregation communication (Python binding of stepmesh)",
    package_dir={"": "python"},
    packages=["stepmesh"],
    package_data={"stepmesh": ["*.pyi", "py.typed"]},
    ext_modules=[Extension("stepmesh._stepmesh", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=[],
    # vLLM calls every vllm.general_plugins entry point in each process it
    # starts: this one adds StepMeshAFDConnector to the AFD plugin's factory and
    # supported names (a no-op without afd_plugin). docs/python.md.
    entry_points={"vllm.general_plugins": ["stepmesh_afd = stepmesh.vllm:register"]},
    zip_safe=False,
)
