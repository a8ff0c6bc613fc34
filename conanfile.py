# Conan 2 recipe for trellis (header-only). `conan create .` builds nothing; it packages the
# headers and checks them with test_package/. C++20 is required of the consumer's compiler.
import os
import re

from conan import ConanFile
from conan.tools.files import copy, load


class TrellisConan(ConanFile):
    name = "trellis"
    description = "Header-only C++20/CUDA building blocks for parallel training programs"
    license = "Apache-2.0"
    topics = ("deep-learning", "distributed-training", "cuda", "mpi", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "include/*", "LICENSE", "README.md"
    no_copy_source = True

    def set_version(self):
        # The version's single source is include/trellis/core/version.hpp.
        text = load(self, os.path.join(self.recipe_folder, "include", "trellis", "core", "version.hpp"))
        parts = [re.search(rf"#define TRELLIS_VERSION_{p} (\d+)", text).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def package_id(self):
        self.info.clear()

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "*", os.path.join(self.source_folder, "include"),
             os.path.join(self.package_folder, "include"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "trellis")
        self.cpp_info.set_property("cmake_target_name", "trellis::trellis")
        if self.settings.os in ("Linux", "FreeBSD"):
            self.cpp_info.system_libs = ["pthread"]
