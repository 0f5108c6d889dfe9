// A C++ program that embeds Python and generates with a specedge bundle (the README example).
//
//   g++ -std=c++17 host.cpp $(python3-config --embed --cflags --ldflags) -o host
//   ./host BUNDLE_DIR            # prints the new token ids, one line
//
// Python finds spec_runtime on its usual path (set PYTHONPATH for a virtual environment).
#include <Python.h>

#include <cstdio>

namespace {

// Owns one reference; Py_XDECREF on scope exit.
struct Ref {
    PyObject* p;
    explicit Ref(PyObject* obj) : p(obj) {}
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    ~Ref() { Py_XDECREF(p); }
    explicit operator bool() const { return p != nullptr; }
};

// gen = spec_runtime.load(bundle); r = gen.generate([ids], max_new_tokens=16); print(r.tokens)
bool generate(const char* bundle) {
    Ref runtime(PyImport_ImportModule("spec_runtime"));
    if (!runtime) return false;
    Ref gen(PyObject_CallMethod(runtime.p, "load", "s", bundle));
    if (!gen) return false;
    Ref method(PyObject_GetAttrString(gen.p, "generate"));
    Ref args(Py_BuildValue("([iiiii])", 72, 101, 108, 108, 111));  // fixed prompt token ids
    Ref kwargs(Py_BuildValue("{s:i,s:d}", "max_new_tokens", 16, "temperature", 0.0));
    if (!method || !args || !kwargs) return false;
    Ref result(PyObject_Call(method.p, args.p, kwargs.p));
    if (!result) return false;
    Ref tokens(PyObject_GetAttrString(result.p, "tokens"));  // list[int]
    if (!tokens) return false;
    for (Py_ssize_t i = 0; i < PyList_Size(tokens.p); ++i) {
        std::printf("%s%ld", i ? " " : "", PyLong_AsLong(PyList_GetItem(tokens.p, i)));
    }
    std::printf("\n");
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s BUNDLE_DIR\n", argv[0]);
        return 2;
    }
    Py_Initialize();
    bool ok = generate(argv[1]);
    if (!ok) PyErr_Print();  // a bad bundle prints the library's message and hint
    if (Py_FinalizeEx() < 0) return 120;
    return ok ? 0 : 1;
}
