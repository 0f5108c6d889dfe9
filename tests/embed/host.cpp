// A C++ program that embeds Python and generates with a draftproof bundle (the README example).
//
//   PY=$(python3 -c 'import sys; print(sys.executable)')    # the Python that has draftproof
//   g++ -std=c++17 host.cpp $(python3-config --embed --cflags --ldflags) -DDRAFTPROOF_PYTHON="\"$PY\"" -o host
//   ./host BUNDLE_DIR ["PROMPT"]     # prints the generated text, then its token ids on one line
//
// The interpreter starts as DRAFTPROOF_PYTHON does: same prefix and site-packages, a virtual
// environment's included, from any directory and whatever PATH says; no PYTHONPATH needed.
#include <Python.h>

#include <cstdio>

#ifndef DRAFTPROOF_PYTHON
#error "define DRAFTPROOF_PYTHON, the path of the Python to run as: see the build command above"
#endif

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

// r = spec_runtime.load(bundle).generate(prompt, max_new_tokens=16, temperature=0.0)
// print(r.text); print(*r.tokens)
bool generate(const char* bundle, const char* prompt) {
    Ref runtime(PyImport_ImportModule("spec_runtime"));
    if (!runtime) return false;
    Ref gen(PyObject_CallMethod(runtime.p, "load", "s", bundle));  // once; keep it
    if (!gen) return false;
    Ref method(PyObject_GetAttrString(gen.p, "generate"));
    Ref args(Py_BuildValue("(N)", PyUnicode_DecodeFSDefault(prompt)));  // argv's encoding
    Ref kwargs(Py_BuildValue("{s:i,s:d}", "max_new_tokens", 16, "temperature", 0.0));
    if (!method || !args || !kwargs) return false;
    Ref result(PyObject_Call(method.p, args.p, kwargs.p));
    if (!result) return false;
    Ref text(PyObject_GetAttrString(result.p, "text"));      // str
    Ref tokens(PyObject_GetAttrString(result.p, "tokens"));  // list[int]
    if (!text || !tokens) return false;
    Py_ssize_t size;
    const char* utf8 = PyUnicode_AsUTF8AndSize(text.p, &size);
    if (!utf8) return false;
    std::fwrite(utf8, 1, size, stdout);
    std::printf("\n");
    for (Py_ssize_t i = 0; i < PyList_Size(tokens.p); ++i) {
        std::printf("%s%ld", i ? " " : "", PyLong_AsLong(PyList_GetItem(tokens.p, i)));
    }
    std::printf("\n");
    return true;
}

// The library's InputError (a bad bundle or value) is one line that names the value and the
// fix, printed as the command-line tools print it; anything else is a bug: its traceback.
void report_error() {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Ref runtime(PyImport_ImportModule("spec_runtime"));
    Ref input_error(runtime ? PyObject_GetAttrString(runtime.p, "InputError") : nullptr);
    PyErr_Clear();  // spec_runtime itself may be what failed to import
    if (input_error && value && PyObject_IsInstance(value, input_error.p) == 1) {
        Ref message(PyObject_Str(value));
        const char* text = message ? PyUnicode_AsUTF8(message.p) : nullptr;
        std::fprintf(stderr, "error: %s\n", text ? text : "(a message that is not text)");
        PyErr_Clear();
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return;
    }
    PyErr_Restore(type, value, traceback);
    PyErr_Print();
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2 || argc > 3) {
        std::fprintf(stderr, "usage: %s BUNDLE_DIR [PROMPT]\n", argv[0]);
        return 2;
    }
    // Without a program name, Python would take the first `python3` on PATH as its own and use
    // that one's prefix and site-packages (another Python's, or a virtual environment's or not).
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, DRAFTPROOF_PYTHON);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) Py_ExitStatusException(status);

    bool ok = generate(argv[1], argc > 2 ? argv[2] : "What is speculative decoding?");
    if (!ok) report_error();  // a bad bundle: the library's one line, naming the fix
    if (Py_FinalizeEx() < 0) return 120;
    return ok ? 0 : 1;
}
