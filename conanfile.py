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
    # json: the file formats (io/, train/, plan/ and the umbrella header) read and write JSON with
    # nlohmann-json; without it only the core headers are usable.
    options = {"json": [True, False]}
    default_options = {"json": True}
    exports_sources = "include/*", "LICENSE", "README.md"
    no_copy_source = True

    def set_version(self):
        # The version's single source is include/trellis/core/version.hpp.
        text = load(self, os.path.join(self.recipe_folder, "include", "trellis", "core", "version.hpp"))
        parts = [re.search(rf"#define TRELLIS_VERSION_{p} (\d+)", text).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def requirements(self):
        if self.options.json:
            self.requires("nlohmann_json/[>=3.10 <4]")

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
        core = self.cpp_info.components["core"]
        core.set_property("cmake_target_name", "trellis::trellis")
        core.bindirs = []
        core.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            core.system_libs = ["pthread"]
        if self.options.json:
            json = self.cpp_info.components["json"]
            json.set_property("cmake_target_name", "trellis::json")
            json.bindirs = []
            json.libdirs = []
            json.includedirs = []
            json.requires = ["core", "nlohmann_json::nlohmann_json"]
