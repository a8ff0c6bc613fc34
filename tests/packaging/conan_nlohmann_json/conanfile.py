# Offline stand-in for ConanCenter's nlohmann_json recipe, used only by conan_create.sh: it
# packages the system's headers (Debian's nlohmann-json3-dev) under the name, version and CMake
# target ConanCenter's recipe gives, so trellis' recipe is tested with its real requirement.
import os
import re

from conan import ConanFile
from conan.tools.files import copy, load


class NlohmannJsonFromSystem(ConanFile):
    name = "nlohmann_json"
    package_type = "header-library"
    no_copy_source = True
    system_include = "/usr/include"

    def set_version(self):
        text = load(self, "/usr/share/cmake/nlohmann_json/nlohmann_jsonConfigVersion.cmake")
        self.version = re.search(r'set\(PACKAGE_VERSION "([0-9.]+)"\)', text).group(1)

    def package_id(self):
        self.info.clear()

    def package(self):
        copy(self, "*", os.path.join(self.system_include, "nlohmann"),
             os.path.join(self.package_folder, "include", "nlohmann"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "nlohmann_json")
        self.cpp_info.set_property("cmake_target_name", "nlohmann_json::nlohmann_json")
